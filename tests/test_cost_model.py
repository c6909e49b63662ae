"""The cost model: its cache trajectory against the engine's and a brute-force simulation, its formula by hand."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.cost_model import CostModel, Rates, Shapes, cache_lengths
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.budgets import BinnedBudget, FixedBudget
from sparserl.rollout.sparsity.eviction import KVCompression

SHAPES = Shapes(layers=2, hidden=4, q_heads=2, kv_heads=1, head_dim=2, vocab=10, body_params=100, width=4)
RATES = Rates(flop_rate=1e3, bandwidth=1e3, cached_token_s=0.01, overhead_s=0.5, sparse_overhead_s=0.25,
              compress_overhead_s=1.0, compress_unit_s=0.001)


@pytest.mark.parametrize("schedule", [FixedBudget(24), BinnedBudget(16, (12, 20, 28, 28))])
def test_the_compressions_follow_the_engine(schedule):
    model, _ = make_tiny_model()
    prompt, new, interval = 20, 90, 6
    engine = RolloutEngine(model, KVCompression("rkv", budget=24, window=4, interval=interval, schedule=schedule),
                           record_evictions=True)
    batch = engine.generate([[5] * prompt] * 3, SamplingConfig(new, 1.0, None, 0), torch.Generator().manual_seed(0))
    lengths, compressions = cache_lengths(prompt, new, schedule, interval)
    assert len(compressions) == batch.kv.compressions
    # Each eviction record holds the columns kept by one layer's compression: its budget.
    first_layer = [e for e in batch.evictions if e.layer == 0]
    assert [e.kept_columns.shape[-1] for e in first_layer] == [budget for _, budget, _ in compressions]
    assert len(lengths) == new - 1 and max(lengths) <= max(b for _, b, _ in compressions) + interval


def simulate(prompt, new_tokens, budget, interval):
    """Grow to B + Δ, cut to B, written as the plain story: one token a step, a cut every Δ steps
    once the cache is over B (the first cut may wait for the cache to pass B)."""
    cache, lengths, cuts, last_cut = prompt, [], [], None
    for step in range(new_tokens - 1):
        due = step >= interval if last_cut is None else step - last_cut >= interval
        if due and cache > budget:
            cuts.append((cache, budget, cache if last_cut is None else cache - budget))
            cache, last_cut = budget, step
        cache += 1
        lengths.append(cache)
    return lengths, cuts


@pytest.mark.parametrize("prompt,new,budget,interval", [(10, 100, 16, 4), (40, 60, 16, 8), (5, 30, 50, 3)])
def test_fixed_budget_trajectory_against_a_simulation(prompt, new, budget, interval):
    assert cache_lengths(prompt, new, FixedBudget(budget), interval) == simulate(prompt, new, budget, interval)


def test_dense_trajectory_and_the_formula_by_hand():
    lengths, compressions = cache_lengths(10, 5, None, 8)
    assert lengths == [11, 12, 13, 14] and compressions == []
    model = CostModel(RATES, SHAPES)
    # One row: weight FLOPs 2·(100 + 40) = 280 → 0.28 s; bytes 140·4 = 560 → 0.56 s; 0.5 s overhead.
    assert model.step_seconds(1, 11) == pytest.approx(0.5 + 0.28 + 0.56 + 0.11)
    assert model.step_seconds(1, 11, sparse=True) == pytest.approx(0.5 + 0.28 + 0.56 + 0.11 + 0.25)
    dense = model.predict_rollout_seconds(1, 10, 5)
    assert dense["total_s"] == pytest.approx(4 * (0.5 + 0.28 + 0.56) + 0.01 * (11 + 12 + 13 + 14))
    # R-KV holding 6 slots cut to 4, 2 appended: units 6 + 2·6 + 6·2 = 30 → 2 layers · (1 + 0.030) s.
    assert model.compression_seconds(1, 6, 4, 2, "rkv") == pytest.approx(2 * 1.030)
    assert model.compression_seconds(1, 6, 4, 2, "snapkv") == pytest.approx(2 * 1.006)


def test_a_sparse_rollout_by_hand():
    """Prompt 4, 6 new tokens, B = 4, Δ = 2: the cache holds 5, 6, then is cut (6 → 4, all 6 new to
    the policy), holds 5, 6, cut again (6 → 4, 2 appended), holds 5."""
    comp = KVCompression("rkv", budget=4, window=1, interval=2)
    assert cache_lengths(4, 6, comp.budgets, 2) == ([5, 6, 5, 6, 5], [(6, 4, 6), (6, 4, 2)])
    model = CostModel(RATES, SHAPES)
    step = 0.5 + 0.28 + 0.56 + 0.25
    first, steady = 6 + 6 * 6 + 6 * 2, 6 + 2 * 6 + 6 * 2  # units of the two compressions
    compress = 2 * (1 + 0.001 * first) + 2 * (1 + 0.001 * steady)
    predicted = model.predict_rollout_seconds(1, 4, 6, comp)
    assert predicted["decode_s"] == pytest.approx(5 * step + 0.01 * (5 + 6 + 5 + 6 + 5))
    assert predicted["compress_s"] == pytest.approx(compress)
    dense = 5 * (step - 0.25) + 0.01 * (5 + 6 + 7 + 8 + 9)
    assert model.predicted_speedup(1, 4, 6, comp) == pytest.approx(dense / (predicted["decode_s"] + compress))
    assert model.predicted_speedup(1, 4, 6, comp, free_compression=True) == pytest.approx(dense / predicted["decode_s"])


def test_a_constant_schedule_predicts_the_fixed_budget():
    model = CostModel(RATES, SHAPES)
    constant = model.predict_rollout_seconds(1, 10, 40, KVCompression(budget=12, interval=4,
                                                                      schedule=BinnedBudget(8, (12,))))
    fixed = model.predict_rollout_seconds(1, 10, 40, KVCompression(budget=12, interval=4))
    assert constant == fixed and fixed["compressions"] > 0


def test_rates_are_probed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    import sparserl.rollout.engine.cost_model as cost_model

    calls = []
    monkeypatch.setattr(cost_model, "probe", lambda *args: calls.append(args) or RATES)
    model, _ = make_tiny_model()
    path = tmp_path / "rates.json"
    first = CostModel.probe(model, 4, cache=path)
    second = CostModel.probe(model, 4, cache=path)
    assert len(calls) == 1 and first.rates == second.rates == RATES
    assert CostModel.load(model, 4, cache=path).rates == RATES
    assert len(json.loads(path.read_text())) == 1
    CostModel.probe(model, 8, cache=path)  # another batch is another entry
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2


def test_scheduled_rows_join_as_rows_leave_by_hand():
    """Two rows in flight, dense, responses of 5, 1, 1 and 5 tokens, prompt 10; rates probed at 1 row.
    A row of length L feeds its tokens 0..L-2, its forward i attending over 11 + i cached tokens, and
    leaves at its own step L - 1; a waiting request feeds its first token the step after.
    Step 0: row A (5) feeds at 11; B (1) leaves, C (1) joins. Step 1: A at 12; C leaves, D (5) joins.
    Steps 2-3: A at 13, 14 and D at 11, 12 (one forward of two rows, over the longer cache).
    Steps 4-5: A has left; D at 13, 14. Waves of two would take 8 one-row forwards, not 6."""
    model = CostModel(RATES, SHAPES, probe_rows=1)
    step = model.step_seconds
    expected = step(1, 11) + step(1, 12) + step(2, 13) + step(2, 14) + step(1, 13) + step(1, 14)
    predicted = model.predict_scheduled([5, 1, 1, 5], prompt=10, rows_in_flight=2)
    assert predicted["decode_s"] == pytest.approx(expected) and predicted["cohorts"] == 3
    # Two rows' attention costs twice one row's: 0.01 s per cached token and row.
    assert step(2, 11) - step(1, 11) == pytest.approx(2 * (100 + 40) / 1e3 + 0.01 * 11)
    with pytest.raises(ValueError, match="probe_rows"):
        CostModel(RATES, SHAPES).predict_scheduled([3], 10, 1)


def test_a_row_reserves_what_the_engine_reserves():
    model, _ = make_tiny_model()
    shapes = Shapes.of(model)
    compression = KVCompression("rkv", budget=24, window=4, interval=6)
    for comp in (None, compression):
        assert shapes.row_bytes(20, 90, comp) == RolloutEngine(model, comp).row_bytes(20, 90)
