"""The rollout engine, dense and sparse: log-probs, exactness, padding, positions, memory, replay."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tiny_gemma3, make_tiny_model, replay_logprobs

from sparserl.model.forward import response_logprobs
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.sparsity.policies import POLICIES
from sparserl.tasks.pointer_walk import PointerWalkTask

ALL_POLICIES = sorted(POLICIES)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


def _prompts(tokenizer, count=6, letters=8, ragged=True):
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(letters, min_letters=letters).examples(count, seed=1)]
    if ragged:  # left padding: rows of different prompt lengths
        prompts[1] = prompts[1][:6]
        prompts[3] = prompts[3][:11]
    return prompts


def _sample(model, tokenizer, compression=None, temperature=1.0, max_new=40, seed=0, prompts=None, eos=True):
    engine = RolloutEngine(model, compression)
    sampling = SamplingConfig(max_new, temperature, eos_token_id=tokenizer.eos_token_id if eos else None)
    return engine.generate(prompts or _prompts(tokenizer), sampling, torch.Generator().manual_seed(seed))


def test_dense_sampler_logprobs_match_teacher_forcing(tiny):
    model, tokenizer = tiny
    batch = _sample(model, tokenizer)
    with torch.no_grad():
        reference, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1])
    mask = batch.response_mask.bool()
    assert mask.sum() > 100
    assert torch.allclose(batch.sampler_logprobs[mask], reference[mask], atol=1e-5)
    assert (batch.sampler_logprobs[~mask] == 0).all()


def test_sampler_logprob_is_of_the_tempered_distribution(tiny):
    model, tokenizer = tiny
    batch = _sample(model, tokenizer, temperature=0.7, max_new=8)
    with torch.no_grad():
        logits = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask.long(),
                       position_ids=(batch.prompt_mask.long().cumsum(1) - 1).clamp(min=0)).logits[:, -1].double()
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, batch.response_ids[:, :1]).squeeze(1)
    assert torch.allclose(batch.sampler_logprobs[:, 0].double(), expected, atol=1e-5)


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("per_head", [False, True])
def test_huge_budget_is_bitwise_dense(tiny, policy, per_head):
    model, tokenizer = tiny
    dense = _sample(model, tokenizer)
    sparse = _sample(model, tokenizer, KVCompression(policy, budget=10**6, window=4, interval=4, per_head=per_head))
    assert torch.equal(dense.response_ids, sparse.response_ids)
    assert torch.equal(dense.sampler_logprobs, sparse.sampler_logprobs)
    assert sparse.kv.compressions == 0


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("per_head", [False, True])
def test_padding_is_never_kept_while_real_tokens_remain(tiny, policy, per_head):
    model, tokenizer = tiny
    budget = 10
    batch = _sample(model, tokenizer, KVCompression(policy, budget=budget, window=3, interval=3, per_head=per_head),
                    eos=False)
    real = batch.attention_mask.bool()
    assert batch.evictions, "the budget should force compressions"
    for event in batch.evictions:
        kept = event.kept_columns  # [N, Hs, B]
        kept_real = real.gather(1, kept.flatten(1)).view_as(kept)
        layer_budget = kept.shape[-1]  # PyramidKV gives each layer its own budget
        assert layer_budget == POLICIES[policy](window=3).layer_budget(budget, event.layer, len(model.model.layers)) \
            if policy == "pyramidkv" else layer_budget == budget
        real_so_far = real[:, : event.first_column].sum(dim=1)  # real tokens cached before the compression
        expected_real = real_so_far.clamp(max=layer_budget)[:, None].expand_as(kept_real[..., 0])
        assert torch.equal(kept_real.sum(dim=-1), expected_real)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_memory_bound(tiny, policy):
    model, tokenizer = tiny
    budget, interval = 12, 4
    batch = _sample(model, tokenizer, KVCompression(policy, budget=budget, window=4, interval=interval), eos=False)
    config = model.config
    slot_bytes = 2 * len(batch) * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    layers = config.num_hidden_layers
    width = batch.prompt_ids.shape[1]
    # PyramidKV spreads the budget unevenly over layers; everything else holds one budget per layer.
    bound = slot_bytes * layers * (max(width, budget) + interval) if policy != "pyramidkv" else \
        slot_bytes * sum(max(width, b) + interval for b in
                         [POLICIES[policy](window=4).layer_budget(budget, i, layers) for i in range(layers)])
    assert batch.kv.kv_peak_bytes <= bound
    assert batch.kv.kv_dense_bytes == slot_bytes * layers * (width + batch.response_ids.shape[1])
    assert batch.kv.kv_peak_bytes < 0.6 * batch.kv.kv_dense_bytes
    top_budget = POLICIES[policy](window=4).layer_budget(budget, 0, layers) if policy == "pyramidkv" else budget
    assert (batch.kv.kept_tokens <= top_budget + interval).all()
    assert torch.allclose(batch.kv.kept_tokens + batch.kv.evicted_tokens,
                          (batch.attention_mask.sum(1) - 1).float())


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("per_head", [False, True])
def test_replay_reproduces_sampler_logprobs_with_gradients(tiny, policy, per_head):
    model, tokenizer = tiny
    batch = _sample(model, tokenizer, KVCompression(policy, budget=10, window=3, interval=3, per_head=per_head))
    assert batch.kv.compressions > 0
    replayed = replay_logprobs(model, batch)
    mask = batch.response_mask.bool()
    assert (replayed - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
    (replayed * batch.response_mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)
    # The dense recompute of the same tokens differs: eviction really changed the sampler.
    with torch.no_grad():
        dense, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1])
    assert (dense - batch.sampler_logprobs).abs()[mask].max() > 1e-3


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_positions_after_eviction_match_a_brute_force_recompute(policy):
    """One layer, so the kept set is the whole context: re-running plain HF attention over just the
    kept tokens, each at its original position, must give the sampler's greedy tokens and log-probs."""
    model, tokenizer = make_tiny_model(seed=3, num_hidden_layers=1)
    prompts = _prompts(tokenizer, count=4)
    batch = _sample(model, tokenizer, KVCompression(policy, budget=9, window=3, interval=3), temperature=0.0,
                    max_new=24, prompts=prompts, eos=False)
    assert batch.evictions
    ids, real = batch.input_ids, batch.attention_mask.bool()
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    width = batch.prompt_ids.shape[1]
    events = sorted(batch.evictions, key=lambda e: e.first_column)
    for row in range(len(batch)):
        for step in range(1, int(batch.response_lengths[row])):
            query = width + step - 1  # the column fed to produce response token `step`
            held = [e for e in events if e.first_column <= query]
            if held:
                last = held[-1]
                context = sorted(set(last.kept_columns[row, 0].tolist()) | set(range(last.first_column, query + 1)))
            else:
                context = list(range(query + 1))
            context = [c for c in context if real[row, c]]
            with torch.no_grad():
                logits = model(input_ids=ids[row, context][None], position_ids=positions[row, context][None]).logits
            logp = torch.log_softmax(logits[0, -1].double(), dim=-1)
            token = batch.response_ids[row, step]
            assert int(logp.argmax()) == int(token)
            assert abs(float(logp[token]) - float(batch.sampler_logprobs[row, step])) < 1e-5


def _tiny_gemma3():
    return make_tiny_gemma3(["sliding_attention"] * 3 + ["full_attention"], sliding_window=6)


def test_hybrid_model_compresses_only_full_attention_layers(tiny):
    _, tokenizer = tiny
    model = _tiny_gemma3()
    dense = _sample(model, tokenizer, max_new=30, eos=False)
    with torch.no_grad():
        reference, _ = response_logprobs(model, dense.input_ids, dense.attention_mask, dense.prompt_ids.shape[1])
    assert (dense.sampler_logprobs - reference).abs()[dense.response_mask.bool()].max() < 1e-5
    sparse = _sample(model, tokenizer, KVCompression("snapkv", budget=10, window=3, interval=3), max_new=30, eos=False)
    assert {e.layer for e in sparse.evictions} == {3}
    by_type = sparse.kv.kv_peak_bytes_by_layer_type
    assert by_type["sliding_attention"] > 0 and by_type["full_attention"] > 0
    replayed = replay_logprobs(model, sparse)
    assert (replayed - sparse.sampler_logprobs).abs()[sparse.response_mask.bool()].max() <= 1e-5


def test_policy_parameters_reach_the_policies():
    from sparserl.config.schema import load_config

    config = load_config(None, {"kv_policy": "rkv", "kv_lambda": 0.3, "kv_similarity_threshold": 0.8,
                                "kv_kernel_size": 5, "kv_pooling": "mean"})
    policy = KVCompression.from_rollout_config(config.rollout).build_policy()
    assert (policy.lam, policy.similarity_threshold) == (0.3, 0.8)
    assert (policy.importance.kernel_size, policy.importance.pooling) == (5, "mean")
    streaming = load_config(None, {"kv_policy": "streamingllm", "kv_sinks": 2})
    sinks = KVCompression.from_rollout_config(streaming.rollout).build_policy()
    assert sinks.sinks == 2


def _rkv_redundancy(keys: torch.Tensor, real: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy distribution `[N, Hkv, L]` from scratch, in float64, as its paper states it: the cosine
    similarity of the real slots' keys, diagonal zeroed, a pair above `threshold` counted by the older slot only
    (slots are in column order), the mean of each row over the other real slots, softmaxed over the real slots."""
    unit = keys.double() / keys.double().norm(dim=-1, keepdim=True).clamp_min(1e-12) * real[..., None]
    similarity = unit @ unit.transpose(-1, -2)
    length = similarity.shape[-1]
    slot = torch.arange(length, device=keys.device)
    newer_than = slot[:, None] > slot[None, :]  # row i, column j: i is the more recent slot
    spared = (similarity > threshold) & newer_than
    similarity = similarity.masked_fill(spared | (slot[:, None] == slot[None, :]), 0.0)
    mean = similarity.sum(dim=-1) / (real.sum(dim=-1, keepdim=True) - 1).clamp_min(1)
    return mean.masked_fill(~real, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


@pytest.mark.parametrize("per_head", [False, True])
def test_rkv_incremental_redundancy_equals_recomputing_it(tiny, per_head):
    """R-KV keeps its similarity row sums between compressions; at every compression of a real
    rollout they must give what recomputing the whole similarity matrix gives."""
    from sparserl.rollout.sparsity.policies import RKV

    class CheckedRKV(RKV):
        checked = 0

        def score(self, inputs):
            scores = super().score(inputs)
            real, _ = inputs.per_kv_head()
            kept_up = self._distribution(self._row_sums[inputs.layers], real)
            assert torch.allclose(kept_up.double(), _rkv_redundancy(inputs.keys, real, self.similarity_threshold),
                                  atol=1e-6)
            CheckedRKV.checked += 1
            return scores

    model, tokenizer = tiny
    engine = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3, per_head=per_head))
    engine.policy = CheckedRKV(similarity_threshold=0.2)  # a low threshold exercises the sparing rule
    sampling = SamplingConfig(40, 1.0, eos_token_id=None)
    for seed in (0, 1):  # a second rollout must not reuse the first one's sums
        engine.generate(_prompts(tokenizer), sampling, torch.Generator().manual_seed(seed))
    assert CheckedRKV.checked > 20


def _regrouped_stacks(monkeypatch):
    """Cut each compression's layers into stacks of 1, 2, then all layers in turn, so that the stacks change
    between the compressions of one rollout (as they do when their size crosses `SCORED_KEY_BYTES`)."""
    from sparserl.rollout.sparsity import eviction

    sizes = iter([1, 2, 10**6] * 1000)

    def regrouped(layers, bytes_per_layer):
        size = next(sizes)
        return [layers[start:start + size] for start in range(0, len(layers), size)]

    monkeypatch.setattr(eviction, "scored_stacks", regrouped)


def test_the_scored_stacks_hold_at_most_their_bytes_and_one_layer_at_least():
    from sparserl.rollout.sparsity.eviction import SCORED_KEY_BYTES, scored_stacks

    # 28 layers x 512 rows x 4,096 slots x 2 heads x 128 dims in float32: 2 GiB a layer, one layer a stack
    assert scored_stacks(list(range(28)), 512 * 4096 * 2 * 128 * 4) == [[layer] for layer in range(28)]
    assert scored_stacks([3, 5, 7], SCORED_KEY_BYTES + 1) == [[3], [5], [7]]
    quarter = SCORED_KEY_BYTES // 4
    assert scored_stacks(list(range(10)), quarter) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert scored_stacks(list(range(30)), 1000) == [list(range(30))]


def test_rkv_row_sums_stay_exact_when_the_stacks_change(tiny, monkeypatch):
    """R-KV's sums are kept per stack of layers; when a compression stacks the layers differently, the sums of
    an older stack are out of date and must not be reused: recomputed from scratch, the redundancy agrees."""
    from sparserl.rollout.sparsity.policies import RKV

    checked = []

    class CheckedRKV(RKV):
        def score(self, inputs):
            scores = super().score(inputs)
            real, _ = inputs.per_kv_head()
            kept_up = self._distribution(self._row_sums[inputs.layers], real)
            assert torch.allclose(kept_up.double(), _rkv_redundancy(inputs.keys, real, self.similarity_threshold),
                                  atol=1e-6)
            checked.append(inputs.layers)
            return scores

    _regrouped_stacks(monkeypatch)
    model, tokenizer = tiny
    engine = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3))
    engine.policy = CheckedRKV(similarity_threshold=0.2)
    engine.generate(_prompts(tokenizer), SamplingConfig(40, 1.0, eos_token_id=None), torch.Generator().manual_seed(0))
    assert len(set(checked)) == 3 and len(checked) > 12  # (0,), (1,) and (0, 1), each again after the others


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_how_the_layers_are_stacked_for_scoring_changes_no_rollout(tiny, policy, monkeypatch):
    """Scoring the layers one stack at a time or in stacks that change between compressions keeps the same
    slots, so the same tokens and log-probs, as scoring them all together."""
    model, tokenizer = tiny
    compression = KVCompression(policy, budget=10, window=3, interval=3)
    together = _sample(model, tokenizer, compression, max_new=30, eos=False)
    _regrouped_stacks(monkeypatch)
    regrouped = _sample(model, tokenizer, compression, max_new=30, eos=False)
    assert together.evictions and torch.equal(together.response_ids, regrouped.response_ids)
    assert torch.allclose(together.sampler_logprobs, regrouped.sampler_logprobs, atol=1e-6)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_after_a_compression_the_buffers_shrink_to_the_budget_plus_an_interval(tiny, policy, monkeypatch):
    """A prompt longer than the budget fills the buffers past it; once compressed, a layer's buffers hold
    B + Δ + 1 slots (what its rows fill before the next compression), and the rollout is the one sampled over
    the uncut buffers."""
    from sparserl.rollout.cache import BufferCache

    model, tokenizer = tiny
    prompts = [list(range(5, 29)), list(range(7, 31))]  # 24 tokens each, the budget 10
    compression = KVCompression(policy, budget=10, window=3, interval=3)
    monkeypatch.setattr(BufferCache, "shrink", lambda self, slots: False)
    uncut = _sample(model, tokenizer, compression, max_new=20, eos=False, prompts=prompts)
    monkeypatch.undo()
    capacities = []
    original = BufferCache.shrink

    def recorded(self, slots):
        moved = original(self, slots)
        capacities.append(({layer.capacity for layer in self.layers}, {layer.length for layer in self.layers}))
        return moved

    monkeypatch.setattr(BufferCache, "shrink", recorded)
    cut = _sample(model, tokenizer, compression, max_new=20, eos=False, prompts=prompts)
    layers = len(model.model.layers)
    budgets = {POLICIES[policy](window=3).layer_budget(10, i, layers) for i in range(layers)} \
        if policy == "pyramidkv" else {10}
    assert capacities and all(lengths <= budgets for _, lengths in capacities)
    assert all(held == {length + 4 for length in lengths} for held, lengths in capacities)
    assert torch.equal(uncut.response_ids, cut.response_ids)
    assert torch.allclose(uncut.sampler_logprobs, cut.sampler_logprobs, atol=1e-6)
    assert uncut.kv.kv_peak_bytes == cut.kv.kv_peak_bytes  # the prompt's prefill is the peak either way


@pytest.mark.parametrize("policy", ["rkv", "streamingllm"])
def test_acceptance_rate_of_a_recorded_rollout(tiny, policy):
    """A budget past every length makes the sampler the dense policy (α = 1 at every token); a small
    one moves it (some α < 1)."""
    from sparserl.learner.alpha import rollout_acceptance

    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(30, 1.0, eos_token_id=None)
    for budget, check in ((10**6, "dense"), (10, "sparse")):
        engine = RolloutEngine(model, KVCompression(policy, budget=budget, window=3, interval=3),
                               record_distributions=True)
        batch = engine.generate(prompts, sampling, torch.Generator().manual_seed(0))
        assert batch.sampler_distribution.shape == (*batch.response_ids.shape, model.config.vocab_size)
        # The recorded distribution is the one each token was drawn from.
        drawn = batch.sampler_distribution.gather(2, batch.response_ids[..., None]).squeeze(2)
        assert torch.allclose(drawn * batch.response_mask, batch.sampler_logprobs, atol=1e-6)
        alpha = rollout_acceptance(model, batch, temperature=1.0)
        real = batch.response_mask.bool()
        if check == "dense":
            assert torch.allclose(alpha[real], torch.ones_like(alpha[real]), atol=1e-5)
        else:
            assert float(alpha[real].min()) < 0.99 and float(alpha[real].max()) <= 1 + 1e-5


@pytest.mark.parametrize("sparsity", ["rkv", "block"])
def test_a_large_vocabulary_gets_the_exact_alpha_from_the_replay(tiny, sparsity, monkeypatch):
    """Over FULL_DISTRIBUTION_VOCAB the engine keeps no [N, T, V] distributions but what replays the
    sampler, and α rebuilt from the replay equals α from the recorded distributions."""
    from sparserl.learner.alpha import rollout_acceptance
    from sparserl.rollout.engine import engine as engine_module
    from sparserl.rollout.sparsity.block_sparse import BlockSparsity

    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    compression = (KVCompression("rkv", budget=10, window=3, interval=3) if sparsity == "rkv"
                   else BlockSparsity(budget=8, page_size=4, dense_layers=0))
    for temperature in (1.3, 0.0):
        sampling = SamplingConfig(30, temperature, eos_token_id=None)
        recorded = RolloutEngine(model, compression, record_evictions=False, record_distributions=True) \
            .generate(prompts, sampling, torch.Generator().manual_seed(0))
        with monkeypatch.context() as patch:
            patch.setattr(engine_module, "FULL_DISTRIBUTION_VOCAB", model.config.vocab_size - 1)
            large = RolloutEngine(model, compression, record_evictions=False, record_distributions=True)
            replayed = large.generate(prompts, sampling, torch.Generator().manual_seed(0))
        assert large.record_evictions and replayed.replayable and replayed.sampler_distribution is None
        assert torch.equal(replayed.response_ids, recorded.response_ids)
        expected = rollout_acceptance(model, recorded, temperature)
        real = recorded.response_mask.bool()
        assert float(expected[real].min()) < 0.99  # the sampler does differ from the dense policy
        assert (rollout_acceptance(model, replayed, temperature) - expected).abs().max() <= 1e-5


def test_alpha_refuses_a_batch_it_cannot_rebuild_the_sampler_of(tiny):
    from sparserl.learner.alpha import rollout_acceptance

    model, tokenizer = tiny
    batch = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3), record_evictions=False) \
        .generate(_prompts(tokenizer), SamplingConfig(20, 1.0, eos_token_id=None), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="record_distributions=True"):
        rollout_acceptance(model, batch, temperature=1.0)


def test_a_budget_schedule_grows_memory_with_it_and_replays_exactly(tiny):
    """Under a schedule the budget follows the cached length: each compression keeps the budget of
    its length's bin, memory never exceeds the largest budget reached plus an interval, the replay
    still reproduces the sampler, and a schedule past every length is bitwise dense."""
    from sparserl.rollout.sparsity.budgets import BinnedBudget

    model, tokenizer = tiny
    prompts = _prompts(tokenizer, ragged=False)  # 20 tokens each
    schedule = BinnedBudget(8, (6, 6, 6, 10, 14, 30, 40))  # 24-31: 10; 32-39: 14; 40-47: 30; 48 on: 40
    interval = 3
    batch = _sample(model, tokenizer, KVCompression("snapkv", budget=99, window=2, interval=interval, schedule=schedule),
                    max_new=24, prompts=prompts, eos=False)
    width = batch.prompt_ids.shape[1]
    assert batch.evictions
    for event in batch.evictions:
        assert event.kept_columns.shape[-1] == schedule.budget(event.first_column), event.first_column
    reached = max(schedule.budget(e.first_column) for e in batch.evictions)
    layers = len(model.model.layers)
    slot_bytes = batch.kv.kv_dense_bytes // (width + batch.response_ids.shape[1])
    assert batch.kv.kv_peak_bytes <= slot_bytes * (max(width, reached) + interval)
    assert batch.kv.kv_peak_bytes < slot_bytes * (schedule.max_budget + interval)  # not sized for the last bin
    mask = batch.response_mask.bool()
    assert (replay_logprobs(model, batch) - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
    huge = BinnedBudget(8, (10**6,))
    dense = _sample(model, tokenizer, max_new=24, prompts=prompts, eos=False)
    sparse = _sample(model, tokenizer, KVCompression("snapkv", budget=4, window=2, interval=3, schedule=huge),
                     max_new=24, prompts=prompts, eos=False)
    assert torch.equal(dense.response_ids, sparse.response_ids)
    assert torch.equal(dense.sampler_logprobs, sparse.sampler_logprobs)
    assert layers >= 1


def test_the_engine_uses_no_deprecated_transformers_argument(tiny):
    # transformers 5.24 renamed forward's `past_key_values` to `cache` and will drop the old name in 5.40;
    # the engine must pass the cache under whatever name the installed version takes.
    model, tokenizer = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        batch = _sample(model, tokenizer, KVCompression("rkv", budget=16, interval=4), max_new=24)
    assert batch.kv.compressions > 0
