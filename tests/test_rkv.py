"""R-KV's row sums and kept slots, against a float64 similarity matrix built here: through compressions, stacked
layers, padding, per-head selection, rows leaving and a whole rollout (the shared inputs and brute forces of every
policy are in test_kv_policies.py)."""

from __future__ import annotations

import pytest
import torch
from test_kv_policies import HKV, HQ, D, L, W, assert_real_scores_match, brute_rkv, make_inputs

from sparserl.rollout.sparsity.policies import RKV, ScoringInputs, select_slots

torch.set_num_threads(1)


def float64_row_sums(keys, real, columns, threshold):
    """`[N, Hkv, L]` float64 from the whole similarity matrix: each real slot's sum of key cosine similarities to
    the other real slots, less those to older near-duplicates (sim > threshold, smaller column); 0 on padding. A
    zero key (a pad token sampled, in the first layer) is similar to nothing, as F.normalize makes it."""
    n, heads, length, _ = keys.shape
    real, columns = real.expand(n, heads, length), columns.expand(n, heads, length)
    unit = keys.double() / keys.double().norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = unit @ unit.transpose(-1, -2)
    counted = real[..., :, None] & real[..., None, :] & ~torch.eye(length, dtype=torch.bool)
    spared = (sim > threshold) & (columns[..., :, None] > columns[..., None, :])
    return torch.where(counted & ~spared, sim, 0.0).sum(dim=-1)


def float64_redundancy(sums, real):
    """R-KV's redundancy `[N, Hkv, L]` from float64 row sums: the mean similarity, softmaxed over the real slots."""
    real = real.expand_as(sums)
    mean = sums / (real.sum(dim=-1, keepdim=True) - 1).clamp_min(1)
    return mean.masked_fill(~real, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def compressed_then_extended(inputs, slots, gen, appended, rows=None):
    """The inputs after keeping `slots` (of the stacked rows `rows`, all when None) and appending `appended` new
    real slots (some near-duplicates of kept keys, so that the threshold bites across old and new), with fresh
    window queries."""
    if rows is not None:
        inputs = ScoringInputs(inputs.keys[rows], inputs.queries[rows], inputs.query_real[rows], inputs.real[rows],
                               inputs.columns[rows], None, inputs.layers)
        slots = slots[rows]
    n, hkv, _, d = inputs.keys.shape
    per_head = slots.expand(n, hkv, -1)
    kept = inputs.keys.gather(2, per_head[..., None].expand(-1, -1, -1, d))
    new = torch.randn(n, hkv, appended, d, generator=gen)
    new[:, :, 0] = kept[:, :, 2] + 0.1 * torch.randn(n, hkv, d, generator=gen)
    new[:, :, 1] = new[:, :, 0] + 0.1 * torch.randn(n, hkv, d, generator=gen)
    start = int(inputs.columns.max()) + 1
    new_columns = torch.arange(start, start + appended).expand(n, slots.shape[1], -1)
    return ScoringInputs(
        keys=torch.cat([kept, new], dim=2), queries=torch.randn(n, HQ, W, d, generator=gen),
        query_real=torch.ones(n, W, dtype=torch.bool),
        real=torch.cat([inputs.real.gather(2, slots), torch.ones_like(new_columns, dtype=torch.bool)], dim=2),
        columns=torch.cat([inputs.columns.gather(2, slots), new_columns], dim=2),
        attention_mass=None, layers=inputs.layers)


@pytest.mark.parametrize("per_head", [False, True])
def test_rkv_kept_between_compressions_matches_float64_loops(per_head):
    """R-KV updates its similarity sums between compressions (appended rows in, evicted rows out,
    in blocks); at every compression the score must still be the float64 loops' on the slots held."""
    gen = torch.Generator().manual_seed(5)
    inputs = make_inputs(per_head=per_head, seed=2)
    policy = RKV(lam=0.3, similarity_threshold=0.2, kernel_size=3)
    policy.BLOCK_ROWS, policy.CPU_BLOCK_ELEMENTS = 3, 3 * L  # several tiles per product, and a last partial one
    budget = 14
    for _ in range(4):
        score = policy.score(inputs)
        assert_real_scores_match(score, brute_rkv(inputs, 0.3, 0.2, 3, "max"), inputs, tol=1e-6)
        slots = select_slots(score, inputs.real, inputs.columns, budget, W)
        policy.before_keep(inputs, slots)
        inputs = compressed_then_extended(inputs, slots, gen, L - budget)


def stacked_inputs(layers, rows, length, per_head, gen):
    """Inputs of `layers` layers of `rows` rows stacked, with near-duplicate keys, a left-padded row and a row with
    padding between real slots (a finished row's slots)."""
    n = layers * rows
    keys = torch.randn(n, HKV, length, D, generator=gen)
    twins = torch.randint(0, length, (length // 3,), generator=gen)
    keys[:, :, twins] = keys[:, :, torch.randint(0, length, (len(twins),), generator=gen)] \
        + 0.2 * torch.randn(n, HKV, len(twins), D, generator=gen)
    hs = HKV if per_head else 1
    real = torch.ones(n, hs, length, dtype=torch.bool)
    real[1::rows, :, :length // 4] = False
    real[0::rows, :, length // 2::5] = False
    columns = torch.arange(length).expand(n, hs, length).clone()
    return ScoringInputs(keys=keys, queries=torch.randn(n, HQ, W, D, generator=gen),
                         query_real=torch.ones(n, W, dtype=torch.bool), real=real, columns=columns,
                         attention_mass=None, layers=tuple(range(layers)))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("layers,length,budget,appended,block_rows,block", [
    (1, 20, 16, 4, 64, 10**6),  # every product one block; evicted slots removed every time (L·E = 80 < B²/2)
    (2, 64, 16, 4, 3, 40),  # recomputed from the kept keys after the long prompt (E = 48), then removed (E = 4)
    (3, 40, 9, 9, 1, 1),  # recomputed every time (L·E >= B²/2); tiles of one row of one (row, head) pair
    (2, 150, 40, 12, 16, 2000),  # tiles of several rows and pairs, the evicted slots' columns in blocks
])
def test_rkv_row_sums_through_compressions_equal_the_float64_matrix(per_head, layers, length, budget, appended,
                                                                     block_rows, block, monkeypatch):
    """R-KV's row sums, kept between compressions in float32, against the whole float64 similarity matrix of the
    slots held: after scoring (all slots) and after keeping (the kept slots against each other), through several
    compressions of stacked layers, padding, per-head and shared selection, rows leaving, every block size. With
    lam = 0 the score is minus the redundancy, so it is checked too."""
    gen = torch.Generator().manual_seed(length)
    rows = 3
    inputs = stacked_inputs(layers, rows, length, per_head, gen)
    policy = RKV(lam=0.0, similarity_threshold=0.2)
    policy.BLOCK_ROWS, policy.CPU_BLOCK_ELEMENTS = block_rows, block
    removals = []
    remove = RKV._evicted_sums
    monkeypatch.setattr(RKV, "_evicted_sums", lambda self, *args: removals.append(1) or remove(self, *args))
    removed_when = []  # whether each compression's kept sums were the held ones less the evicted slots
    for compression in range(4):
        real, columns = inputs.per_kv_head()
        held = float64_row_sums(inputs.keys, real, columns, 0.2)
        score = policy.score(inputs)
        sums = policy._row_sums[inputs.layers]
        assert torch.allclose(sums.double().masked_fill(~real, 0), held, atol=1e-5)
        assert torch.allclose(-score.double(), float64_redundancy(held, real), atol=1e-7)
        slots = select_slots(score, inputs.real, inputs.columns, budget, W)
        evicted = inputs.keys.shape[2] - budget
        removed_when.append(inputs.keys.shape[2] * evicted < budget * (budget + 1) // 2)  # fewer products
        policy.before_keep(inputs, slots)
        kept = ScoringInputs(inputs.keys.gather(2, slots.expand(-1, HKV, -1)[..., None].expand(-1, -1, -1, D)),
                             inputs.queries, inputs.query_real, inputs.real.gather(2, slots),
                             inputs.columns.gather(2, slots), None, inputs.layers)
        kept_real, kept_columns = kept.per_kv_head()
        kept_sums = policy._row_sums[inputs.layers].double().masked_fill(~kept_real, 0)
        assert torch.allclose(kept_sums, float64_row_sums(kept.keys, kept_real, kept_columns, 0.2), atol=1e-5)
        leaving = None
        if compression == 1:  # row 1 of each layer finishes and leaves the batch
            remaining = torch.tensor([0, 2])
            policy.select_rows(remaining)
            leaving = (torch.arange(layers)[:, None] * rows + remaining).reshape(-1)
            rows = 2
        inputs = compressed_then_extended(inputs, slots, gen, appended, leaving)
    assert len(removals) == sum(removed_when)


class Float64RKV(RKV):
    """R-KV scored from scratch at every compression: its importance (SnapKV's, tested above) and the redundancy of
    the whole float64 similarity matrix; nothing kept between compressions."""

    def score(self, inputs):
        real, columns = inputs.per_kv_head()
        attention = self.importance.score(inputs).double().masked_fill(~real, 0.0)
        importance = attention / attention.sum(dim=-1, keepdim=True).clamp_min(1e-300)
        sums = float64_row_sums(inputs.keys, real, columns, self.similarity_threshold)
        return self.lam * importance - (1 - self.lam) * float64_redundancy(sums, real)

    def before_keep(self, inputs, slots):
        pass

    def select_rows(self, rows):
        pass


@pytest.mark.parametrize("per_head", [False, True])
def test_rkv_keeps_the_slots_of_the_float64_scorer_through_a_rollout(per_head):
    """A whole rollout (prompts long enough that the first compression recomputes the kept sums, compressions
    every 3 steps that remove the evicted slots, rows ending and leaving, waiting prompts joining) keeps, at every
    compression, the slots the float64 scorer keeps, so it samples the same tokens."""
    from conftest import make_tiny_model

    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression

    model, tokenizer = make_tiny_model(seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 60, (int(length),), generator=gen).tolist()
               for length in torch.randint(12, 40, (10,), generator=gen)]
    sampling = SamplingConfig(30, 1.0, tokenizer.eos_token_id, tokenizer.pad_token_id)
    left = []

    class CountedRKV(RKV):
        def select_rows(self, rows):
            left.append(len(rows))
            super().select_rows(rows)

    def sample(policy):
        engine = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3, per_head=per_head),
                               record_evictions=True)
        engine.policy = policy
        return engine.generate(prompts, sampling, seeds=list(range(len(prompts))), max_rows=6)

    kept_up = sample(CountedRKV(similarity_threshold=0.3))
    scratch = sample(Float64RKV(similarity_threshold=0.3))
    assert left, "no row left the batch: the test needs rows to end"
    assert len(kept_up.evictions) == len(scratch.evictions) > 12
    assert all(torch.equal(a.kept_columns, b.kept_columns) for a, b in zip(kept_up.evictions, scratch.evictions))
    assert torch.equal(kept_up.response_ids, scratch.response_ids)


def test_every_layer_sharing_a_length_and_budget_is_scored_in_one_call():
    """A compression scores all the layers that hold the same slots and budget as one stack: one policy call, not
    one per layer (R-KV's vLLM port reports +22.5% from scoring all layers in one call)."""
    from conftest import make_tiny_model

    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression

    model, tokenizer = make_tiny_model(seed=1, num_hidden_layers=3)
    scored = []

    class Recorded(RKV):
        def score(self, inputs):
            scored.append((inputs.layers, inputs.keys.shape[0]))
            return super().score(inputs)

    engine = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3))
    engine.policy = Recorded()
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16][: 8 + i % 4] for i in range(4)]
    batch = engine.generate(prompts, SamplingConfig(20, 1.0, None, tokenizer.pad_token_id), seeds=list(range(4)))
    assert batch.kv.compressions > 3 and len(scored) == batch.kv.compressions
    assert all(layers == (0, 1, 2) and rows == 3 * 4 for layers, rows in scored)
