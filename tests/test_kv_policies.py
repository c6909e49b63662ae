"""KV policies and select_slots, each against an independent float64 brute force written here."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from sparserl.rollout.sparsity.policies import (
    H2O,
    POLICIES,
    RKV,
    PyramidKV,
    ScoringInputs,
    SnapKV,
    StreamingLLM,
    policy_options,
    select_slots,
)

torch.set_num_threads(1)

N, HKV, HQ, L, D, W = 2, 2, 4, 20, 8, 4
PAD_LEFT = 5  # row 1 is left-padded by this many slots


def make_inputs(per_head: bool = False, seed: int = 0, interleaved_pad: bool = False) -> ScoringInputs:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(N, HKV, L, D, generator=gen)
    # Some near-duplicate keys so that R-KV's similarity threshold bites.
    keys[:, :, 10] = keys[:, :, 3] + 0.1 * torch.randn(N, HKV, D, generator=gen)
    keys[:, :, 15] = keys[:, :, 3] + 0.1 * torch.randn(N, HKV, D, generator=gen)
    queries = torch.randn(N, HQ, W, D, generator=gen)
    query_real = torch.ones(N, W, dtype=torch.bool)
    query_real[1, 0] = False
    hs = HKV if per_head else 1
    real = torch.ones(N, hs, L, dtype=torch.bool)
    real[1, :, :PAD_LEFT] = False
    if interleaved_pad:  # slots of a finished row, fed as padding during decoding
        real[0, :, 12] = False
        real[0, :, 17] = False
    if per_head:  # heads hold different columns after per-head eviction
        columns = torch.stack([torch.sort(torch.randperm(40, generator=gen)[:L]).values for _ in range(N * hs)])
        columns = columns.view(N, hs, L)
    else:
        columns = torch.arange(L).expand(N, hs, L).clone()
    mass = torch.rand(N, HKV, L, generator=gen)
    return ScoringInputs(keys=keys, queries=queries, query_real=query_real, real=real, columns=columns,
                         attention_mass=mass, layers=(0,))


def real_of(inputs, n, h):
    hs = inputs.real.shape[1]
    return [bool(x) for x in inputs.real[n, h if hs > 1 else 0].tolist()]


def cols_of(inputs, n, h):
    hs = inputs.columns.shape[1]
    return [int(x) for x in inputs.columns[n, h if hs > 1 else 0].tolist()]


# ---- brute-force references (plain loops, float64) -------------------------------------------

def brute_snapkv(inputs, kernel, pooling):
    k = inputs.keys.double().tolist()
    q = inputs.queries.double().tolist()
    qr = inputs.query_real.tolist()
    group = HQ // HKV
    out = [[[0.0] * L for _ in range(HKV)] for _ in range(N)]
    for n in range(N):
        for h in range(HKV):
            real = real_of(inputs, n, h)
            per_q_head = []
            for g in range(group):
                hq = h * group + g
                acc = [0.0] * L
                for t in range(W):
                    if not qr[n][t]:
                        continue
                    logits = [sum(q[n][hq][t][d] * k[n][h][l][d] for d in range(D)) / math.sqrt(D)
                              if real[l] else None for l in range(L)]
                    top = max(x for x in logits if x is not None)
                    exps = [math.exp(x - top) if x is not None else 0.0 for x in logits]
                    total = sum(exps)
                    for l in range(L):
                        acc[l] += exps[l] / total
                per_q_head.append(acc)
            head = [max(v[l] for v in per_q_head) if pooling == "max" else sum(v[l] for v in per_q_head) / group
                    for l in range(L)]
            half = kernel // 2
            for l in range(L):
                neighbours = [head[j] for j in range(l - half, l + half + 1) if 0 <= j < L]
                out[n][h][l] = max(neighbours) if pooling == "max" else sum(neighbours) / kernel
    return out


def brute_rkv(inputs, lam, threshold, kernel, pooling):
    snap = brute_snapkv(inputs, kernel, pooling)
    k = inputs.keys.double().tolist()
    out = [[[0.0] * L for _ in range(HKV)] for _ in range(N)]
    for n in range(N):
        for h in range(HKV):
            real, cols = real_of(inputs, n, h), cols_of(inputs, n, h)
            total = sum(snap[n][h][l] for l in range(L) if real[l])
            norms = [math.sqrt(sum(x * x for x in k[n][h][l])) for l in range(L)]
            mean_sim = [0.0] * L
            for i in range(L):
                if not real[i]:
                    continue
                values = []
                for j in range(L):
                    if j == i or not real[j]:
                        continue
                    s = sum(k[n][h][i][d] * k[n][h][j][d] for d in range(D)) / (norms[i] * norms[j])
                    if s > threshold and cols[i] > cols[j]:
                        s = 0.0  # i is the more recent of a near-duplicate pair: spared
                    values.append(s)
                mean_sim[i] = sum(values) / len(values)
            top = max(mean_sim[i] for i in range(L) if real[i])
            z = sum(math.exp(mean_sim[i] - top) for i in range(L) if real[i])
            for i in range(L):
                if real[i]:
                    red = math.exp(mean_sim[i] - top) / z
                    out[n][h][i] = lam * snap[n][h][i] / total - (1 - lam) * red
    return out


def expected_keep(score_rows, real, cols, budget, window):
    """Brute-force select: window most recent real, then best-scored real; score_rows[l] float64."""
    real_slots = [l for l in range(L) if real[l]]
    recent = sorted(real_slots, key=lambda l: -cols[l])[:window]
    rest = sorted((l for l in real_slots if l not in recent), key=lambda l: -score_rows[l])
    return set(recent) | set(rest[: budget - len(recent)]), recent, rest


def head_scores(brute, inputs, n, h):
    if inputs.real.shape[1] == 1:
        return [sum(brute[n][hh][l] for hh in range(HKV)) for l in range(L)]
    return brute[n][h]


def assert_valid_topk(kept, brute, inputs, budget, window, tol=1e-6):
    """Kept = window + a top-(budget - window) of the float64 scores (ties within tol allowed)."""
    for n in range(N):
        for h in range(inputs.real.shape[1]):
            real, cols = real_of(inputs, n, h), cols_of(inputs, n, h)
            s = head_scores(brute, inputs, n, h)
            _, recent, rest = expected_keep(s, real, cols, budget, window)
            got = set(kept[n, h].tolist())
            assert set(recent) <= got
            others_kept = [l for l in got if l not in recent]
            others_dropped = [l for l in rest if l not in got]
            assert len(others_kept) == budget - len(recent)
            assert min(s[l] for l in others_kept) >= max(s[l] for l in others_dropped) - tol


# ---- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("per_head", [False, True])
def test_streamingllm_keeps_sinks_and_recent(per_head):
    inputs = make_inputs(per_head=per_head, interleaved_pad=True)
    sinks, budget, window = 3, 9, 4
    kept = select_slots(StreamingLLM(sinks=sinks).score(inputs), inputs.real, inputs.columns, budget, window)
    for n in range(N):
        for h in range(inputs.real.shape[1]):
            real, cols = real_of(inputs, n, h), cols_of(inputs, n, h)
            by_col = sorted((l for l in range(L) if real[l]), key=lambda l: cols[l])
            assert set(kept[n, h].tolist()) == set(by_col[:sinks]) | set(by_col[-(budget - sinks):])


def assert_real_scores_match(score, brute, inputs, tol):
    """Every real slot's score equals the float64 loop's, within `tol`."""
    for n in range(N):
        for h in range(HKV):
            for l in range(L):
                if real_of(inputs, n, h)[l]:
                    assert score[n, h, l].item() == pytest.approx(brute[n][h][l], abs=tol)


@pytest.mark.parametrize("pooling", ["max", "mean"])
@pytest.mark.parametrize("per_head", [False, True])
def test_snapkv_matches_float64_loops(pooling, per_head):
    inputs = make_inputs(per_head=per_head)
    policy = SnapKV(kernel_size=5, pooling=pooling)
    score = policy.score(inputs)
    brute = brute_snapkv(inputs, 5, pooling)
    assert score.shape == (N, HKV, L) and score.dtype == torch.float32
    assert_real_scores_match(score, brute, inputs, tol=1e-5)
    kept = select_slots(score, inputs.real, inputs.columns, 10, W)
    assert_valid_topk(kept, brute, inputs, 10, W)


@pytest.mark.parametrize("policy", [SnapKV(kernel_size=5), RKV(kernel_size=3)], ids=["snapkv", "rkv"])
def test_a_row_without_real_slots_scores_finite_and_leaves_the_others_exact(policy):
    """A (row, head) with no real slot has nothing to rank: its scores are finite (the softmax's NaN is
    zeroed) and the other row's scores are the float64 loop's."""
    reference = make_inputs(seed=1)  # row 1's float64 scores depend on row 1 only
    brute = brute_snapkv(reference, 5, "max") if isinstance(policy, SnapKV) else brute_rkv(reference, 0.1, 0.5, 3, "max")
    inputs = make_inputs(seed=1)
    inputs.real[0] = False
    score = policy.score(inputs)
    assert torch.isfinite(score).all()
    for h in range(HKV):
        for slot in range(PAD_LEFT, L):
            assert score[1, h, slot].item() == pytest.approx(brute[1][h][slot], abs=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lam,threshold", [(0.1, 0.5), (0.6, 0.2)])
def test_rkv_matches_float64_loops(per_head, lam, threshold):
    inputs = make_inputs(per_head=per_head, seed=1)
    score = RKV(lam=lam, similarity_threshold=threshold, kernel_size=3).score(inputs)
    brute = brute_rkv(inputs, lam, threshold, 3, "max")
    assert_real_scores_match(score, brute, inputs, tol=1e-6)
    kept = select_slots(score, inputs.real, inputs.columns, 10, W)
    assert_valid_topk(kept, brute, inputs, 10, W, tol=1e-7)


@pytest.mark.parametrize("per_head", [False, True])
def test_h2o_keeps_heavy_hitters_and_window(per_head):
    inputs = make_inputs(per_head=per_head, interleaved_pad=True)
    kept = select_slots(H2O().score(inputs), inputs.real, inputs.columns, 9, W)
    mass = inputs.attention_mass.double().tolist()
    for n in range(N):
        for h in range(inputs.real.shape[1]):
            s = head_scores(mass, inputs, n, h)
            want, _, _ = expected_keep(s, real_of(inputs, n, h), cols_of(inputs, n, h), 9, W)
            assert set(kept[n, h].tolist()) == want


def test_h2o_needs_mass():
    inputs = make_inputs()
    inputs.attention_mass = None
    assert H2O.needs_attention_mass
    with pytest.raises(ValueError):
        H2O().score(inputs)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("budget", [6, 12, 19])
def test_select_slots_invariants(name, per_head, budget):
    inputs = make_inputs(per_head=per_head, interleaved_pad=True, seed=2)
    score = POLICIES[name]().score(inputs)
    assert score.shape == (N, HKV, L) and score.dtype == torch.float32
    kept = select_slots(score, inputs.real, inputs.columns, budget, W)
    hs = inputs.real.shape[1]
    assert kept.shape == (N, hs, budget)
    for n in range(N):
        for h in range(hs):
            real, cols = real_of(inputs, n, h), cols_of(inputs, n, h)
            idx = kept[n, h].tolist()
            assert len(set(idx)) == budget
            assert [cols[i] for i in idx] == sorted(cols[i] for i in idx)  # column order
            real_slots = [l for l in range(L) if real[l]]
            n_real_kept = sum(real[i] for i in idx)
            assert n_real_kept == min(budget, len(real_slots))  # padding only once real ran out
            recent = sorted(real_slots, key=lambda l: -cols[l])[:W]
            assert set(recent) <= set(idx)


def test_select_slots_window_larger_than_budget_keeps_most_recent():
    inputs = make_inputs(interleaved_pad=True)
    kept = select_slots(torch.randn(N, HKV, L), inputs.real, inputs.columns, 5, 8)
    for n in range(N):
        real = real_of(inputs, n, 0)
        assert set(kept[n, 0].tolist()) == set([l for l in range(L) if real[l]][-5:])


@pytest.mark.parametrize("num_layers", [2, 4, 8, 28])
@pytest.mark.parametrize("budget,window", [(32, 8), (64, 8), (20, 4)])
def test_pyramidkv_budgets(num_layers, budget, window):
    policy = PyramidKV(window=window)
    budgets = [policy.layer_budget(budget, i, num_layers) for i in range(num_layers)]
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert budgets[0] > budgets[-1]
    assert all(b > window for b in budgets)
    assert sum(budgets) <= num_layers * budget
    assert sum(budgets) / num_layers >= budget - 1
    assert PyramidKV(window=window).layer_budget(budget, 0, 1) == budget


def test_pyramidkv_scores_like_snapkv():
    inputs = make_inputs()
    assert torch.equal(PyramidKV().score(inputs), SnapKV().score(inputs))


def test_registry_names():
    assert {"streamingllm", "h2o", "snapkv", "rkv", "pyramidkv"} <= set(POLICIES)


def test_select_slots_infinite_scores_do_not_displace_window():
    real = torch.ones(1, 1, 10, dtype=torch.bool)
    columns = torch.arange(10).view(1, 1, 10)
    scores = torch.full((1, 1, 10), float("inf"))
    scores[0, 0, 0] = float("nan")
    kept = select_slots(scores, real, columns, 4, 3)
    assert {7, 8, 9} <= set(kept[0, 0].tolist()) and 0 not in kept[0, 0].tolist()


def _another_valid_value(option):
    if typing.get_origin(option.annotation) is typing.Literal:
        return next(v for v in typing.get_args(option.annotation) if v != option.default)
    return option.default - 2 if option.annotation is int else option.default / 2


@pytest.mark.parametrize("key", sorted(policy_options()))
def test_every_policy_option_is_a_flag_that_reaches_each_policy_taking_it(key):
    from sparserl.config.schema import load_config
    from sparserl.rollout.sparsity.eviction import KVCompression

    option = policy_options()[key]
    value = _another_valid_value(option)
    assert option.policies, key
    for name in option.policies:
        config = load_config(None, {"kv_policy": name, key: str(value)})  # as the command line gives it
        policy = KVCompression.from_rollout_config(config.rollout).build_policy()
        assert type(policy) is POLICIES[name] and getattr(policy, option.field) == value
    others = sorted(set(POLICIES) - set(option.policies))
    if others:
        with pytest.raises(ValueError, match=f"does not apply to kv_policy {others[0]}"):
            load_config(None, {"kv_policy": others[0], key: value})


def _select_slots_by_sorts(scores, real, columns, budget, window):
    """select_slots' general path (recency by sorts), whatever the columns."""
    if real.shape[1] == 1 and scores.shape[1] != 1:
        scores = scores.sum(dim=1, keepdim=True)
    scores = scores.to(torch.float64).expand_as(real)
    recent_first = torch.where(real, columns, -1).argsort(dim=-1, descending=True, stable=True)
    in_window = real & (recent_first.argsort(dim=-1) < window)
    finite_max = torch.finfo(torch.float64).max
    tiered = scores.nan_to_num(nan=-finite_max, posinf=finite_max, neginf=-finite_max)
    tiered = tiered.masked_fill(in_window, float("inf")).masked_fill(~real, float("-inf"))
    by_score = tiered.gather(-1, recent_first).argsort(dim=-1, descending=True, stable=True)
    chosen = recent_first.gather(-1, by_score[..., :budget])
    return chosen.gather(-1, columns.gather(-1, chosen).argsort(dim=-1))


@pytest.mark.parametrize("seed", range(6))
def test_select_slots_column_order_shortcut_equals_sorts(seed):
    """With slots in column order select_slots skips two sorts; the kept slots must be the sorts' own,
    ties (equal scores, padding anywhere) included, and other column layouts take the sorts."""
    gen = torch.Generator().manual_seed(seed)
    n, hs, length = 7, 2, 40
    real = torch.rand(n, hs, length, generator=gen) > 0.3
    real[0] = False  # a row of padding only
    scores = torch.randint(0, 4, (n, hs, length), generator=gen).float()  # many ties
    scores[1, 0, 3] = float("nan")
    columns = torch.randint(1, 4, (n, hs, length), generator=gen).cumsum(dim=-1)
    for cols in (columns, columns.flip(-1), columns - 5):  # in order; decreasing; in order but negative
        for budget, window in ((10, 4), (25, 8), (40, 3), (5, 8)):
            assert torch.equal(select_slots(scores, real, cols, budget, window),
                               _select_slots_by_sorts(scores, real, cols, budget, window))


def test_rkv_helpers_equal_their_plain_forms():
    from sparserl.rollout.sparsity.policies.rkv import (
        _gather_rows,
        _true_positions,
        _zero_upper,
    )

    gen = torch.Generator().manual_seed(0)
    for shape, first in (((3, 2, 40, 200), 150), ((2, 2, 4, 30), 20)):  # the where() path and tril_'s
        base = torch.randn(shape, generator=gen)
        expected = base.clone()
        expected[..., first:].tril_(-1)
        _zero_upper(base[..., first:])
        assert torch.equal(base, expected)
    mask = torch.zeros(3, 2, 30, dtype=torch.bool)
    picks = torch.rand(3, 2, 30, generator=gen).argsort(dim=-1)[..., :7]
    mask.scatter_(2, picks, True)
    positions = _true_positions(mask, 7)
    assert torch.equal(positions, mask.float().argsort(dim=-1, descending=True, stable=True)[..., :7])
    with pytest.raises(ValueError):
        _true_positions(mask, 6)
    tensor = torch.randn(3, 2, 30, 5, generator=gen)
    expected = tensor.gather(2, positions[..., None].expand(-1, -1, -1, 5))
    assert torch.equal(_gather_rows(tensor, positions), expected)
    assert torch.equal(_gather_rows(tensor.transpose(0, 1).contiguous().transpose(0, 1), positions), expected)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_gpu_path_without_host_reads_samples_what_the_cpu_shortcuts_sample(policy, monkeypatch):
    """The shortcuts taken where host reads are free (skipped masks, sort-free orders, nonzero) change
    no bit: the same rollout with them turned off (as on a GPU) gives the same tokens, log-probs and
    eviction records."""
    from conftest import make_tiny_model, without_host_reads

    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression

    model, tokenizer = make_tiny_model(seed=2)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12][: 5 + i % 4] for i in range(6)]
    sampling = SamplingConfig(30, 1.0, None, tokenizer.pad_token_id)

    def sample():
        engine = RolloutEngine(model, KVCompression(policy, budget=8, window=3, interval=3), record_evictions=True)
        return engine.generate(prompts, sampling, seeds=list(range(6)))

    cpu = sample()
    without_host_reads(monkeypatch)
    gpu = sample()
    assert torch.equal(cpu.response_ids, gpu.response_ids)
    assert torch.equal(cpu.sampler_logprobs, gpu.sampler_logprobs)
    assert all(torch.equal(a.kept_columns, b.kept_columns) for a, b in zip(cpu.evictions, gpu.evictions))
    assert cpu.kv.compressions > 0
