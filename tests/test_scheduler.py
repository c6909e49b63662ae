"""The rollout scheduler: rows in flight from a KV memory budget, finished rows leaving the batch, and
sampling that does not depend on which rows run together."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, replay_logprobs

from sparserl.errors import ConfigError
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import rows_in_flight, schedule_rollouts
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.engine.token_draws import draw_tokens, row_uniforms
from sparserl.rollout.sizes import parse_memory
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.sparsity.policies import POLICIES
from sparserl.tasks.pointer_walk import PointerWalkTask

SPARSITIES = {"dense": None, **{name: KVCompression(name, budget=10, window=3, interval=3) for name in POLICIES},
              "block": BlockSparsity(budget=16, page_size=4, dense_layers=1)}


@pytest.fixture(scope="module")
def tiny64():
    """The tiny model in float64 (batch composition then changes nothing beyond 1e-12), biased towards
    EOS so that its rows end at many different lengths (3 to 30 tokens)."""
    model, tokenizer = make_tiny_model(seed=5)
    model = model.double()
    bias = torch.zeros(model.lm_head.out_features, dtype=torch.float64)
    bias[tokenizer.eos_token_id] = 2.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model, tokenizer


def _prompts(tokenizer, count=14):
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(8, min_letters=5).examples(count, seed=2)]
    prompts[3] = prompts[3][:7]  # ragged, so left padding differs from row to row
    return prompts


def _eos_often(tokenizer) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=30, temperature=1.0, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("rows", [1, 7, None])
@pytest.mark.parametrize("sparsity", sorted(SPARSITIES))
def test_rows_in_flight_change_no_sampled_token_in_float64(tiny64, sparsity, rows):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, SPARSITIES[sparsity], record_evictions=True)
    prompts = _prompts(tokenizer)
    seeds = list(range(100, 100 + len(prompts)))
    sampling = _eos_often(tokenizer)
    whole = schedule_rollouts(engine, prompts, sampling, seeds)
    waves = schedule_rollouts(engine, prompts, SamplingConfig(**{**sampling.__dict__, "max_rows": rows or 0}), seeds)
    assert len(set(whole.response_lengths.tolist())) >= 4  # rows end at many lengths: they leave at different steps
    assert torch.equal(waves.response_ids, whole.response_ids)
    assert torch.equal(waves.response_lengths, whole.response_lengths)
    assert (waves.sampler_logprobs - whole.sampler_logprobs).abs().max() <= 1e-6
    assert waves.kv.rows_in_flight == (rows or len(prompts))
    # The records belong to the requests: the merged waves replay exactly.
    mask = waves.response_mask.bool()
    assert (replay_logprobs(model, waves).detach() - waves.sampler_logprobs).abs()[mask].max() <= 1e-6


def test_a_row_alone_samples_what_it_samples_in_a_batch(tiny64):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, SPARSITIES["rkv"])
    prompts, sampling = _prompts(tokenizer), _eos_often(tokenizer)
    sampling = SamplingConfig(**{**sampling.__dict__, "prompt_width": max(map(len, prompts))})
    batch = schedule_rollouts(engine, prompts, sampling, list(range(len(prompts))))
    alone = schedule_rollouts(engine, prompts[5:6], sampling, [5])
    length = int(alone.response_lengths[0])
    assert length == int(batch.response_lengths[5])
    assert torch.equal(alone.response_ids[0, :length], batch.response_ids[5, :length])


def test_finished_rows_leave_the_batch(tiny64):
    model, tokenizer = tiny64
    sizes = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        batch = RolloutEngine(model).generate(_prompts(tokenizer), _eos_often(tokenizer), seeds=list(range(14)))
    finally:
        handle.remove()
    decode = sizes[1:]
    assert decode == sorted(decode, reverse=True) and decode[-1] <= 14 // 2
    # Every decode step still holds each row that had not ended before it.
    for step, size in enumerate(decode, start=1):
        assert size >= int((batch.response_lengths > step).sum())


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o"])
def test_waiting_requests_join_the_rows_still_decoding(tiny64, sparsity):
    model, tokenizer = tiny64
    calls = []  # (rows, tokens per row) of every forward
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    prompts, limit = _prompts(tokenizer), 5
    try:
        batch = RolloutEngine(model, SPARSITIES[sparsity]).generate(prompts, _eos_often(tokenizer),
                                                                    seeds=list(range(14)), max_rows=limit)
    finally:
        handle.remove()
    decode_rows = [rows for rows, tokens in calls if tokens == 1]
    prefills = [i for i, (rows, tokens) in enumerate(calls) if tokens > 1]
    assert max(decode_rows) <= limit and sum(calls[i][0] for i in prefills) == len(prompts)
    # Some requests were prefilled while others were decoding: the forward after their prefill holds more rows.
    assert any(i + 1 < len(calls) and calls[i + 1][0] > calls[i][0] for i in prefills[1:])
    # In waves of 5, each wave decodes until its longest row ends; joining rows as they free take fewer steps.
    lengths = batch.response_lengths.tolist()
    wave_steps = sum(max(lengths[start:start + limit]) - 1 for start in range(0, len(prompts), limit))
    assert len(decode_rows) < wave_steps


def test_the_measured_peak_stays_within_the_kv_budget_and_sparse_rows_fit_more(tiny64):
    model, tokenizer = tiny64
    prompts, sampling = _prompts(tokenizer), _eos_often(tokenizer)
    width = max(map(len, prompts))
    dense, sparse = RolloutEngine(model), RolloutEngine(model, SPARSITIES["rkv"])
    budget = 3 * dense.row_bytes(width, sampling.max_new_tokens) + 1
    limited = SamplingConfig(**{**sampling.__dict__, "kv_memory_bytes": budget})
    assert rows_in_flight(dense, limited, width, len(prompts)) == 3
    assert rows_in_flight(sparse, limited, width, len(prompts)) > 3
    for engine in (dense, sparse):
        batch = schedule_rollouts(engine, prompts, limited, list(range(len(prompts))))
        assert batch.kv.kv_peak_bytes <= budget
        assert batch.kv.rows_in_flight == rows_in_flight(engine, limited, width, len(prompts))
    # One row's reservation, by hand: two layers, K and V, 2 KV heads of 16 dims, 8 bytes, every slot.
    assert dense.row_bytes(width, 30) == 2 * 2 * 2 * 16 * 8 * (width + 30)


def test_a_budget_too_small_for_one_row_says_the_size_it_needs(tiny64):
    model, tokenizer = tiny64
    sampling = SamplingConfig(**{**_eos_often(tokenizer).__dict__, "kv_memory_bytes": 1000})
    with pytest.raises(ConfigError, match=r"holds no row: one row of this cache needs 0\.\d+ MiB"):
        schedule_rollouts(RolloutEngine(model), _prompts(tokenizer), sampling, list(range(14)))


@pytest.mark.parametrize("text, size", [("64MiB", 64 * 2**20), ("20GiB", 20 * 2**30), ("1.5g", int(1.5 * 2**30)),
                                        ("4096", 4096), ("512 kb", 512 * 1024), ("AUTO", "auto")])
def test_sizes_are_read_as_written(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "0MiB", "-3GiB"])
def test_a_bad_size_is_refused(text):
    with pytest.raises(ConfigError, match="rollout_kv_memory"):
        parse_memory(text)


def _splitmix64_reference(x: int) -> int:
    """splitmix64 (Steele, Lea and Flood) on Python's unbounded integers, reduced mod 2**64."""
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_row_draws_are_splitmix64_of_seed_and_step():
    seeds = [0, 1, 12345, 2 ** 62 + 7]
    expected = [((_splitmix64_reference((_splitmix64_reference(s) + 9) & ((1 << 64) - 1)) >> 11) + 0.5) / 2 ** 53
                for s in seeds]
    assert row_uniforms(torch.tensor(seeds), 9).tolist() == expected


def test_row_seeded_sampling_draws_from_the_distribution():
    """20,000 rows with their own seeds sample a fixed 5-token distribution: counts within 4 standard
    deviations of N·p for every token, and a zero-probability token never drawn."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)
    rows = 20_000
    logits = probs.log().float().expand(rows, -1)
    token, logprob, _ = draw_tokens(logits, 1.0, None, row_uniforms(torch.arange(rows) * 7919 + 3, 0))
    counts = torch.bincount(token, minlength=5).double()
    assert counts[4] == 0
    assert ((counts - rows * probs).abs() <= 4 * (rows * probs * (1 - probs)).sqrt()).all()
    assert torch.allclose(logprob.double(), probs.log()[token], atol=1e-6)


def test_auto_memory_is_a_share_of_what_is_free(monkeypatch):
    import psutil

    from sparserl.rollout.dispatch.scheduler import AUTO_MEMORY_SHARE, resolve_kv_memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 10 * 2**30})())
    assert resolve_kv_memory("auto", torch.device("cpu")) == int(AUTO_MEMORY_SHARE * 10 * 2**30)
    assert resolve_kv_memory("64MiB", torch.device("cpu")) == 64 * 2**20
    assert resolve_kv_memory(None, torch.device("cpu")) is None
