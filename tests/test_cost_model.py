"""The cost model: its cache trajectory against the engine's, and its formula by hand."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from sparserl.cost_model import CostModel, Rates, Shapes, cache_lengths
from sparserl.rollout.engine import KVCompression, RolloutEngine, SamplingConfig
from sparserl.rollout.schedule import BinnedBudget, FixedBudget


@pytest.mark.parametrize("schedule", [FixedBudget(24), BinnedBudget(16, (12, 20, 28, 28))])
def test_the_compressions_follow_the_engine(schedule):
    model, _ = make_tiny_model()
    prompt, new, interval = 20, 90, 6
    engine = RolloutEngine(model, KVCompression("rkv", budget=24, window=4, interval=interval, schedule=schedule),
                           record_evictions=True)
    batch = engine.generate([[5] * prompt] * 3, SamplingConfig(new, 1.0, None, 0), torch.Generator().manual_seed(0))
    lengths, budgets = cache_lengths(prompt, new, schedule, interval)
    assert len(budgets) == batch.kv.compressions
    # Each eviction record holds the columns kept by one layer's compression: its budget.
    first_layer = [e for e in batch.evictions if e.layer == 0]
    assert [e.kept_columns.shape[-1] for e in first_layer] == budgets
    assert len(lengths) == new - 1 and max(lengths) <= max(budgets) + interval


def test_dense_trajectory_and_the_formula_by_hand():
    lengths, budgets = cache_lengths(10, 5, None, 8)
    assert lengths == [11, 12, 13, 14] and budgets == []
    shapes = Shapes(layers=2, hidden=4, q_heads=2, kv_heads=1, head_dim=2, vocab=10, body_params=100, width=4)
    rates = Rates(flop_rate=1e3, bandwidth=1e3, cached_token_s=0.01, overhead_s=0.5, sparse_overhead_s=0.25,
                  compress_overhead_s=1.0, compress_unit_s=0.001)
    model = CostModel(rates, shapes)
    # One row: weight FLOPs 2·(100 + 40) = 280 → 0.28 s; bytes 140·4 = 560 → 0.56 s; 0.5 s overhead.
    assert model.step_seconds(1, 11) == pytest.approx(0.5 + 0.28 + 0.56 + 0.11)
    dense = model.rollout_seconds(1, 10, 5)
    assert dense["total_s"] == pytest.approx(4 * (0.5 + 0.28 + 0.56) + 0.01 * (11 + 12 + 13 + 14))
    # A compression of 2 layers at B = 4, Δ = 2, R-KV: units 6 + 2·6 + 4·2 = 26 → 2·(1 + 0.026) s.
    assert model.compression_seconds(1, 4, 2, "rkv") == pytest.approx(2 * 1.026)
    constant = model.rollout_seconds(1, 10, 40, BinnedBudget(8, (12,)), interval=4)
    fixed = model.rollout_seconds(1, 10, 40, FixedBudget(12), interval=4)
    assert constant == fixed and fixed["compressions"] > 0
