"""Block-sparse attention rollouts: page scores and selection against float64 loops, the engine's
always-kept and dense layers, bitwise-dense when every page fits, exact replay, bf16, hybrid models."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import make_tiny_gemma3, make_tiny_model, replay_logprobs

from sparserl.model.forward import response_logprobs
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.cache import build_cache
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import (
    BlockSelector,
    BlockSparsity,
    PageCentroids,
    page_scores,
    select_pages,
)
from sparserl.rollout.sparsity.budgets import BinnedBudget
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.sparsity.settings import adaptive_budget, sparsity_from_config
from sparserl.tasks.pointer_walk import PointerWalkTask

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model(num_hidden_layers=3)


def _prompts(tokenizer, count=6):
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(8, min_letters=8).examples(count, seed=1)]
    prompts[1] = prompts[1][:6]  # left padding: rows of different prompt lengths
    prompts[3] = prompts[3][:11]
    return prompts


def _sample(model, tokenizer, sparsity=None, max_new=40, seed=0, record=True):
    engine = RolloutEngine(model, sparsity, record_evictions=record)
    sampling = SamplingConfig(max_new, 1.0, eos_token_id=None)
    return engine.generate(_prompts(tokenizer), sampling, torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- float64 references
def _brute_scores(query, keys, real, page):
    """query [N, Hq, D], keys [N, Hkv, L, D], real [N, L] -> [N, pages] float64, by loops."""
    batch, q_heads, _ = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    pages = math.ceil(length / page)
    scores = torch.full((batch, pages), float("-inf"), dtype=torch.float64)
    for n in range(batch):
        for p in range(pages):
            slots = [s for s in range(p * page, min((p + 1) * page, length)) if real[n, s]]
            if not slots:
                continue
            total = 0.0
            for h in range(q_heads):
                centroid = keys[n, h // (q_heads // kv_heads), slots].double().mean(dim=0)
                total += float(query[n, h].double() @ centroid)
            scores[n, p] = total / q_heads
    return scores


def _brute_selection(scores, real, page, keep):
    """Sets of attended pages per row: the sink, the last 2, then the best scores (earlier page on ties)."""
    chosen = []
    for n in range(scores.shape[0]):
        first_real = next((s for s in range(real.shape[1]) if real[n, s]), 0)
        pages = scores.shape[1]
        picked = {first_real // page, pages - 1, pages - 2}
        for p in sorted(range(pages), key=lambda p: (-float(scores[n, p]), p)):
            if len(picked) >= keep:
                break
            picked.add(p)
        chosen.append(picked)
    return chosen


def _random_case(seed, batch=5, q_heads=4, kv_heads=2, length=23, dim=8):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, dim, generator=g)
    keys = torch.randn(batch, kv_heads, length, dim, generator=g)
    real = torch.ones(batch, length, dtype=torch.bool)
    for n, pad in enumerate([0, 3, 6, 9, 1][:batch]):  # left padding, some over a whole page
        real[n, :pad] = False
    real[2, 15] = False  # a row that stopped: a fed slot that holds no token
    return query, keys, real


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_page_scores_match_float64_loop(q_heads, kv_heads):
    query, keys, real = _random_case(0, q_heads=q_heads, kv_heads=kv_heads)  # 23 slots: the last page partial
    centroids = PageCentroids(5, kv_heads, 8, max_pages=8, page_size=PAGE, device=torch.device("cpu"))
    centroids.extend(keys[:, :, :13], real[:, :13])  # a prefill, then one slot at a time
    for s in range(13, 23):
        centroids.extend(keys[:, :, s:s + 1], real[:, s:s + 1])
    pages = math.ceil(23 / PAGE)
    ours = page_scores(query[:, :, None], centroids.means[:, :, :pages], centroids.counts[:, :pages])
    reference = _brute_scores(query, keys, real, PAGE)
    assert torch.equal(torch.isinf(ours), torch.isinf(reference))
    finite = ~torch.isinf(reference)
    assert torch.isinf(reference[2, 0]) and torch.isinf(reference[3, :2]).all()  # whole pages of padding
    assert torch.allclose(ours[finite].double(), reference[finite], atol=1e-5)


@pytest.mark.parametrize("keep", [3, 4, 5])
def test_selection_matches_brute_force(keep):
    for seed in range(4):
        query, keys, real = _random_case(seed)
        scores = _brute_scores(query, keys, real, PAGE)
        sink = torch.tensor([next(s for s in range(23) if real[n, s]) // PAGE for n in range(5)])
        ours = select_pages(scores, _forced(sink, scores.shape[1]), keep)
        assert (ours[:, 1:] > ours[:, :-1]).all()  # ascending, no repeats
        assert [set(row.tolist()) for row in ours] == _brute_selection(scores, real, PAGE, keep)


def _forced(sink: torch.Tensor, pages: int) -> torch.Tensor:
    """The pages every row attends: its sink and the last two."""
    return torch.stack([sink, torch.full_like(sink, pages - 2), torch.full_like(sink, pages - 1)], dim=1)


def test_selection_ties_go_to_the_earlier_page():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0],
                           [float("-inf"), 3.0, 3.0, 3.0, 3.0, 3.0, 5.0, 5.0]])
    sink = torch.tensor([0, 1])
    ours = select_pages(scores, _forced(sink, 8), keep=5)
    real = torch.ones(2, 8 * PAGE, dtype=torch.bool)
    real[1, :PAGE] = False
    expected = [{0, 1, 2, 6, 7}, {1, 2, 3, 6, 7}]
    assert [set(r.tolist()) for r in ours] == _brute_selection(scores, real, PAGE, 5) == expected
    assert torch.equal(select_pages(scores, _forced(sink, 8), 5), ours)


def test_selector_gathers_the_brute_force_pages(tiny):
    """The engine-side selector inside static steps, on a cache filled by hand: the keys, values and mask it gathers
    are those of the float64 loop's pages, the slots past the row's token masked, and its record is those pages."""
    model, _ = tiny
    query, keys, real = _random_case(1, kv_heads=2, dim=16)
    values = torch.randn_like(keys)
    cache = build_cache(model, 5, [32] * 3, False, torch.float32, torch.device("cpu"), full_capacity=32,
                        growth=8, page_size=PAGE)
    layer = cache.layers[2]
    columns = torch.arange(23).expand(5, -1)
    cache.set_incoming(columns[:, :20], real[:, :20])
    layer.update(keys[:, :, :20], values[:, :, :20])
    selector = BlockSelector(BlockSparsity(budget=4 * PAGE, page_size=PAGE, dense_layers=1), cache, steps=8,
                             first_column=20, record=True)
    selector.fold_prompt()
    for step, s in enumerate(range(20, 23)):
        layer.reserve(s + 1)
        cache.begin_static(columns[:, s:s + 1], real[:, s:s + 1])
        layer.update(keys[:, :, s:s + 1], values[:, :, s:s + 1])
        selector.begin_step(s, s + 1)
        mask = layer.static_visible()
        assert selector.select(0, query[:, :, None], mask) is None  # a dense layer
        picked_k, picked_v, picked_mask = selector.select(2, query[:, :, None], mask)
        cache.end_static()
        layer.advance()
        selector.end_static_step()
        expected = _brute_selection(_brute_scores(query, keys[:, :, :s + 1], real[:, :s + 1], PAGE), real, PAGE, 4)
        for n in range(5):
            slots = [p * PAGE + i for p in sorted(expected[n]) for i in range(PAGE)]
            inside = torch.tensor([x <= s for x in slots])
            assert torch.equal(picked_mask[n, 0, 0], inside & real[n, torch.tensor(slots).clamp(max=s)])
            assert torch.equal(picked_k[n][:, inside], keys[n][:, torch.tensor(slots)[inside]])
            assert torch.equal(picked_v[n][:, inside], values[n][:, torch.tensor(slots)[inside]])
            recorded = selector.record.pages[2][n, step, :math.ceil((s + 1) / PAGE)]
            assert set(recorded.nonzero().flatten().tolist()) == expected[n]
    assert set(selector.record.pages) == {1, 2}


def test_engine_keeps_sink_and_recent_pages_and_dense_layers(tiny):
    model, tokenizer = tiny
    sparsity = BlockSparsity(budget=4 * PAGE + 2, page_size=PAGE, dense_layers=1)  # 4 pages
    batch = _sample(model, tokenizer, sparsity)
    record = batch.block_selections
    assert set(record.pages) == {1, 2}  # layer 0 attends densely: nothing recorded
    real = batch.attention_mask.bool()
    width = batch.prompt_ids.shape[1]
    first_real = real.float().argmax(dim=1)
    dropped = 0
    for layer, pages in record.pages.items():
        for step in range(batch.response_ids.shape[1] - 1):
            length = width + step + 1
            count = math.ceil(length / PAGE)
            chosen = pages[:, step, :count]
            if count <= 4:
                assert chosen.all()
                continue
            assert (chosen.sum(dim=1) == 4).all()
            assert chosen[:, -2:].all()
            assert chosen.gather(1, (first_real // PAGE)[:, None]).all()
            dropped += int((~chosen).sum())
    assert dropped > 0


def test_attended_fraction_from_the_record(tiny):
    """KVStats.attended_frac is the mean over decode steps and sparse layers of each row's attended
    real keys over its cached real keys, recounted here from the record and the token mask."""
    model, tokenizer = tiny
    batch = _sample(model, tokenizer, BlockSparsity(budget=4 * PAGE, page_size=PAGE, dense_layers=1))
    real = batch.attention_mask.bool()
    width = batch.prompt_ids.shape[1]
    fractions = []
    for pages in batch.block_selections.pages.values():
        for step in range(batch.response_ids.shape[1] - 1):
            length = width + step + 1
            seen = pages[:, step, torch.arange(length) // PAGE]
            cached = real[:, :length]
            fractions.append(((seen & cached).sum(1).double() / cached.sum(1).double()).mean())
    assert batch.kv.attended_frac == pytest.approx(float(torch.stack(fractions).mean()), abs=1e-6)
    assert batch.kv.attended_frac < 0.8
    assert _sample(model, tokenizer, max_new=8).kv.attended_frac == 1.0


def test_budget_covering_every_page_is_bitwise_dense(tiny):
    model, tokenizer = tiny
    dense = _sample(model, tokenizer)
    width = dense.prompt_ids.shape[1]
    for sparsity in (BlockSparsity(budget=10**6, page_size=PAGE, dense_layers=0),
                     BlockSparsity(budget=PAGE * math.ceil((width + 40) / PAGE), page_size=PAGE, dense_layers=0),
                     BlockSparsity(budget=3 * PAGE, page_size=PAGE, schedule=BinnedBudget(8, (10**6,)))):
        block = _sample(model, tokenizer, sparsity)
        assert torch.equal(dense.response_ids, block.response_ids)
        assert torch.equal(dense.sampler_logprobs, block.sampler_logprobs)
        assert block.kv.attended_frac == 1.0


def test_replay_reproduces_block_sparse_sampler_logprobs(tiny):
    model, tokenizer = tiny
    batch = _sample(model, tokenizer, BlockSparsity(budget=3 * PAGE, page_size=PAGE, dense_layers=1))
    assert any(not p.all() for p in batch.block_selections.pages.values()), "the budget should drop pages"
    mask = batch.response_mask.bool()
    replayed = replay_logprobs(model, batch)
    assert (replayed - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
    (replayed * batch.response_mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)
    rows = torch.tensor([4, 1])  # a micro-batch of rows
    assert (replay_logprobs(model, batch, rows) - batch.sampler_logprobs[rows]).abs()[mask[rows]].max() <= 1e-5
    with torch.no_grad():  # the dense recompute differs: dropping pages really changed the sampler
        dense, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1])
    assert (dense - batch.sampler_logprobs).abs()[mask].max() > 1e-3


def test_a_schedule_grows_the_pages_attended(tiny):
    model, tokenizer = tiny
    schedule = BinnedBudget(16, (12, 12, 16, 24, 32))  # pages 3, 3, 4, 6, 8 by cached length
    batch = _sample(model, tokenizer, BlockSparsity(budget=99, page_size=PAGE, dense_layers=2, schedule=schedule))
    width = batch.prompt_ids.shape[1]
    pages = batch.block_selections.pages[2]
    for step in range(batch.response_ids.shape[1] - 1):
        count = math.ceil((width + step + 1) / PAGE)
        expected = min(count, schedule.budget(width + step) // PAGE)
        assert (pages[:, step, :count].sum(dim=1) == expected).all(), step
    assert (replay_logprobs(model, batch) - batch.sampler_logprobs).abs()[batch.response_mask.bool()].max() <= 1e-5


def test_bf16_block_sparse_rollout():
    model, tokenizer = make_tiny_model(num_hidden_layers=3)
    model = model.to(torch.bfloat16)
    batch = _sample(model, tokenizer, BlockSparsity(budget=3 * PAGE, page_size=PAGE, dense_layers=1))
    mask = batch.response_mask.bool()
    assert torch.isfinite(batch.sampler_logprobs).all() and (batch.sampler_logprobs[mask] < 0).all()
    assert batch.kv.attended_frac < 1.0
    assert (replay_logprobs(model, batch) - batch.sampler_logprobs).abs()[mask].max() < 0.1


def test_hybrid_model_keeps_sliding_layers_dense(tiny):
    _, tokenizer = tiny
    model = make_tiny_gemma3(["sliding_attention", "full_attention"] * 2, sliding_window=6)
    batch = _sample(model, tokenizer, BlockSparsity(budget=3 * PAGE, page_size=PAGE, dense_layers=0))
    assert set(batch.block_selections.pages) == {1, 3}
    assert batch.kv.attended_frac < 1.0
    assert (replay_logprobs(model, batch) - batch.sampler_logprobs).abs()[batch.response_mask.bool()].max() <= 1e-5


def test_sparsity_from_config():
    from sparserl.config.schema import load_config

    block = sparsity_from_config(load_config(None, {"sparsity": "block", "kv_budget": 96, "block_page_size": 8,
                                                    "block_dense_layers": 1}).rollout)
    assert block == BlockSparsity(budget=96, page_size=8, dense_layers=1)
    assert block.budgets.budget(10**5) == 96 and block.pages(0) == 12
    scheduled = dataclasses.replace(block, schedule=BinnedBudget(16, (48, 64)))
    assert scheduled.schedule.budget(20) == 64 and scheduled.pages(0) == 6
    # An adaptive schedule starts at the budget; its controller moves a page at a time, never below 3 pages.
    rollout = load_config(None, {"sparsity": "block", "kv_schedule": "adaptive"}).rollout
    assert sparsity_from_config(rollout).schedule is None
    controller = adaptive_budget(rollout)
    assert controller.step == 16 and controller.floor == 48 and controller.snapshot().budgets == (rollout.kv_budget,)
    assert isinstance(sparsity_from_config(load_config(None, {}).rollout), KVCompression)
