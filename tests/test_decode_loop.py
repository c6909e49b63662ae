"""The continuous-batching decode loop (`rollout/decode_loop.py`), checked from outside: a request samples the
same tokens whatever `max_rows` and whichever rows share the batch (float64), the cache keeps its per-row
invariants at every step, rows that joined mid-flight replay exactly, and the measured peak stays within S rows'
reservation. Every check runs the tiny models the tests build themselves."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    make_tiny_gemma3,
    make_tiny_model,
    replay_logprobs,
    without_host_reads,
)

from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import schedule_rollouts
from sparserl.rollout.engine import decode_loop
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.budgets import BinnedBudget
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.sparsity.policies import POLICIES

WIDTH = 10  # every prompt is padded to it, so a request's columns do not depend on the batch


def _eos_biased(model, eos: int, bias: float = 2.0):
    weights = torch.zeros(model.lm_head.out_features, dtype=torch.float64)
    weights[eos] = bias
    model.lm_head.bias = torch.nn.Parameter(weights)
    return model


@pytest.fixture(scope="module")
def tiny64():
    """Two layers in float64, biased towards EOS so that rows end at many lengths."""
    model, tokenizer = make_tiny_model(seed=5)
    return _eos_biased(model.double(), tokenizer.eos_token_id), tokenizer


@pytest.fixture(scope="module")
def deep64():
    """Four layers (PyramidKV's budgets then differ from layer to layer)."""
    model, tokenizer = make_tiny_model(seed=7, num_hidden_layers=4)
    return _eos_biased(model.double(), tokenizer.eos_token_id), tokenizer


def _prompts(count: int = 7, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 40) for _ in range(rng.randrange(2, WIDTH))] for _ in range(count)]


def _sampling(tokenizer, new: int = 24, eos: bool = True, temperature: float = 1.0) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=new, temperature=temperature,
                          eos_token_id=tokenizer.eos_token_id if eos else None,
                          pad_token_id=tokenizer.pad_token_id, prompt_width=WIDTH)


def _seeds(count: int) -> list[int]:
    return [1000 + 7 * i for i in range(count)]


def _compression(name: str, per_head: bool = False, **settings) -> KVCompression:
    return KVCompression(name, **{"budget": 9, "window": 3, "interval": 3, "per_head": per_head, **settings})


def _same_samples(a, b, distributions: bool = False) -> None:
    assert torch.equal(a.response_lengths, b.response_lengths)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.ended, b.ended)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() <= 1e-6
    if distributions:
        mask = a.response_mask.bool()
        assert (a.sampler_distribution - b.sampler_distribution).abs()[mask].max() <= 1e-6


def _replays(model, batch) -> None:
    mask = batch.response_mask.bool()
    assert (replay_logprobs(model, batch).detach() - batch.sampler_logprobs).abs()[mask].max() <= 1e-6


# --- each request alone vs in a mixed batch -----------------------------------------------------------------

@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_request_samples_the_same_alone_and_with_any_rows_in_flight(tiny64, policy, per_head):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, _compression(policy, per_head), record_evictions=True)
    prompts, sampling = _prompts(), _sampling(tokenizer)
    seeds = _seeds(len(prompts))
    whole = engine.generate(prompts, sampling, seeds=seeds)
    assert whole.kv.compressions > 0 and len(set(whole.response_lengths.tolist())) >= 3
    for rows in (1, 3):
        joined = engine.generate(prompts, sampling, seeds=seeds, max_rows=rows)
        _same_samples(joined, whole)
        assert joined.kv.waves > 1  # requests joined as rows left
        _replays(model, joined)  # the records of requests that joined mid-flight replay exactly
    for request in (0, len(prompts) - 1):  # the first and the last to join
        alone = engine.generate(prompts[request:request + 1], sampling, seeds=seeds[request:request + 1])
        length = int(alone.response_lengths[0])
        assert length == int(whole.response_lengths[request])
        assert torch.equal(alone.response_ids[0, :length], whole.response_ids[request, :length])
        assert (alone.sampler_logprobs[0, :length] - whole.sampler_logprobs[request, :length]).abs().max() <= 1e-6


@pytest.mark.parametrize("compression", [
    _compression("pyramidkv", per_head=True, budget=14, interval=2),
    _compression("h2o", per_head=True, budget=7, interval=2),
    _compression("rkv", budget=7, schedule=BinnedBudget(6, (6, 9, 13, 16))),
    _compression("snapkv", per_head=True, budget=7, schedule=BinnedBudget(5, (5, 8, 12))),
], ids=["pyramidkv-per-head", "h2o-per-head", "rkv-binned", "snapkv-binned-per-head"])
def test_layer_budgets_and_schedules_with_joins(deep64, compression):
    """Four layers: PyramidKV's per-layer budgets (different lengths per layer), H2O's mass per layer, and
    budgets that grow with the cached length, while cohorts join at different columns."""
    model, tokenizer = deep64
    engine = RolloutEngine(model, compression, record_evictions=True, record_distributions=True)
    prompts, sampling = _prompts(), _sampling(tokenizer)
    seeds = _seeds(len(prompts))
    whole = engine.generate(prompts, sampling, seeds=seeds)
    assert whole.kv.compressions > 0
    joined = engine.generate(prompts, sampling, seeds=seeds, max_rows=2)
    _same_samples(joined, whole, distributions=True)
    _replays(model, joined)


def _tiny_hybrid():
    return make_tiny_gemma3(["sliding_attention", "full_attention"] * 2, sliding_window=5).double()


@pytest.mark.parametrize("sparsity", [None, _compression("h2o"), _compression("snapkv", per_head=True)],
                         ids=["dense", "h2o", "snapkv-per-head"])
def test_sliding_window_layers_with_joins(sparsity):
    model = _tiny_hybrid()
    eos = 3
    weights = torch.zeros(97, dtype=torch.float64)
    weights[eos] = 3.0
    model.lm_head.bias = torch.nn.Parameter(weights)
    prompts = [[p % 90 + 5 for p in prompt] for prompt in _prompts(6, seed=3)]
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, eos_token_id=eos, pad_token_id=0,
                              prompt_width=WIDTH)
    engine = RolloutEngine(model, sparsity, record_evictions=True)
    seeds = _seeds(len(prompts))
    whole = engine.generate(prompts, sampling, seeds=seeds)
    assert len(set(whole.response_lengths.tolist())) >= 2
    joined = engine.generate(prompts, sampling, seeds=seeds, max_rows=2)
    _same_samples(joined, whole)
    assert joined.kv.kv_peak_bytes_by_layer_type["sliding_attention"] > 0
    if sparsity is not None:
        assert {e.layer for e in joined.evictions} <= {1, 3} and joined.kv.compressions > 0
    _replays(model, joined)


# --- the cache's invariants, read at every step --------------------------------------------------------------

def _check_state(loop: decode_loop.DecodeLoop, problems: list[str]) -> None:
    rows = loop.batch_rows
    assert sum(cohort.size for cohort in loop.cohorts) == rows == len(loop.rows.requests)
    firsts = loop._firsts()
    for index, layer in enumerate(loop.cache.layers):
        assert layer.batch == rows == layer.keys.shape[0] == layer.real.shape[0]
        lengths = [layer.length] * rows if layer.row_lengths is None else [int(n) for n in layer.row_lengths]
        if rows:
            assert max(lengths) == layer.length
        if layer.slot_counts.tolist() != lengths:
            problems.append(f"layer {index}: the device counts {layer.slot_counts.tolist()} against {lengths}")
        for row, length in enumerate(lengths):
            if layer.real[row, :, length:].any():  # the static step reads the whole buffer
                problems.append(f"layer {index} row {row}: a real slot past its length {length}")
            columns = layer.columns[row, :, :length]
            if length > 1 and not bool((columns.diff(dim=-1) > 0).all()):
                problems.append(f"layer {index} row {row}: columns out of order")
        for first, cohort in zip(firsts, loop.cohorts):  # a cohort's rows hold one length
            if len(set(lengths[first:first + cohort.size])) != 1:
                problems.append(f"layer {index}: a cohort's rows hold different lengths")
        mass = loop.provider.mass.get(index)
        if mass is not None:
            if tuple(mass.shape) != (rows, layer.kv_heads, layer.capacity):
                problems.append(f"layer {index}: mass {tuple(mass.shape)} for {rows} rows of {layer.capacity} slots")
            else:
                for row, length in enumerate(lengths):
                    if mass[row, :, length:].abs().sum() > 0:
                        problems.append(f"layer {index} row {row}: attention mass past its length")
        queries = loop.provider.queries.get(index)
        if queries is not None and (queries.shape[0] != rows or queries.shape[2] != loop.provider.window_real.shape[1]):
            problems.append(f"layer {index}: queries {tuple(queries.shape)} against the window's realness")


@pytest.fixture
def watched(monkeypatch):
    """Checks the loop's state before every decode step (after each prefill, join, release and compression)."""
    problems: list[str] = []
    states: list[tuple[int, bool]] = []  # (rows, whether any layer held per-row lengths)
    decode = decode_loop.DecodeLoop._decode

    def checked(loop, step):
        _check_state(loop, problems)
        states.append((loop.batch_rows, any(layer.row_lengths is not None for layer in loop.cache.layers)))
        return decode(loop, step)

    monkeypatch.setattr(decode_loop.DecodeLoop, "_decode", checked)
    return problems, states


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_cache_keeps_its_invariants_at_every_step(tiny64, watched, policy, per_head):
    problems, states = watched
    model, tokenizer = tiny64
    engine = RolloutEngine(model, _compression(policy, per_head))
    batch = engine.generate(_prompts(), _sampling(tokenizer), seeds=_seeds(7), max_rows=3)
    assert not problems, sorted(set(problems))[:5]
    assert max(rows for rows, _ in states) <= 3
    assert any(differ for _, differ in states)  # rows of different lengths were exercised
    assert batch.kv.kv_peak_bytes <= 3 * engine.row_bytes(WIDTH, 24)


def test_all_rows_at_once_never_holds_per_row_lengths(tiny64, watched):
    """With max_rows >= every request, one cohort: the cache runs the plain one-length code throughout."""
    problems, states = watched
    model, tokenizer = tiny64
    for sparsity in (None, _compression("rkv"), _compression("h2o", per_head=True)):
        RolloutEngine(model, sparsity).generate(_prompts(), _sampling(tokenizer), seeds=_seeds(7), max_rows=99)
    assert not problems and states and not any(differ for _, differ in states)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("sparsity", ["dense", "rkv"])
def test_the_measured_peak_stays_within_the_rows_reservation(tiny64, sparsity, rows):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, None if sparsity == "dense" else _compression(sparsity))
    sampling = _sampling(tokenizer, eos=False, new=12)
    batch = engine.generate(_prompts(), sampling, seeds=_seeds(7), max_rows=rows)
    assert batch.kv.kv_peak_bytes <= rows * engine.row_bytes(WIDTH, 12)


# --- edge cases ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["one-token", "one-row", "no-eos", "greedy", "distributions"])
def test_edge_cases_sample_as_all_at_once(tiny64, case):
    model, tokenizer = tiny64
    sampling, rows, record = _sampling(tokenizer), 3, False
    if case == "one-token":
        sampling = _sampling(tokenizer, new=1)
    elif case == "one-row":
        rows = 1
    elif case == "no-eos":
        sampling = _sampling(tokenizer, eos=False, new=14)
    elif case == "greedy":
        model = make_tiny_model(seed=5)[0].double()  # no EOS bias: greedy would end every row at once
        sampling = _sampling(tokenizer, temperature=0.0, new=14)
    else:
        record = True
    compression = _compression("rkv", budget=6, window=2, interval=2)
    engine = RolloutEngine(model, compression, record_evictions=True, record_distributions=record)
    prompts = _prompts()
    whole = engine.generate(prompts, sampling, seeds=_seeds(7))
    joined = engine.generate(prompts, sampling, seeds=_seeds(7), max_rows=rows)
    _same_samples(joined, whole, distributions=record)
    _replays(model, joined)  # every case samples at T = 1 or greedily: both record the plain softmax
    if case == "one-token":
        assert joined.response_ids.shape[1] == 1 and joined.kv.compressions == 0


def test_sampling_from_one_generator_with_joins(tiny64):
    """Without seeds the rows share a generator (their tokens then depend on the batch); the loop still
    produces well-formed responses that the replay reproduces."""
    model, tokenizer = tiny64
    engine = RolloutEngine(model, _compression("snapkv"), record_evictions=True)
    batch = engine.generate(_prompts(), _sampling(tokenizer), generator=torch.Generator().manual_seed(0), max_rows=3)
    lengths = batch.response_lengths
    assert (lengths >= 1).all() and batch.kv.waves > 1
    assert (batch.sampler_logprobs[batch.response_mask.bool()] <= 0).all()
    assert (batch.sampler_logprobs[~batch.response_mask.bool()] == 0).all()
    ended = batch.ended.nonzero().flatten().tolist()
    assert all(int(batch.response_ids[row, int(lengths[row]) - 1]) == tokenizer.eos_token_id for row in ended)
    _replays(model, batch)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_path_without_host_reads_samples_the_same_with_joins(tiny64, policy, monkeypatch):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, _compression(policy, per_head=policy in ("h2o", "snapkv")), record_evictions=True)
    cpu = engine.generate(_prompts(), _sampling(tokenizer), seeds=_seeds(7), max_rows=3)
    without_host_reads(monkeypatch)
    gpu = engine.generate(_prompts(), _sampling(tokenizer), seeds=_seeds(7), max_rows=3)
    assert torch.equal(cpu.response_ids, gpu.response_ids)
    assert torch.equal(cpu.sampler_logprobs, gpu.sampler_logprobs)
    assert [(e.first_column, e.layer) for e in cpu.evictions] == [(e.first_column, e.layer) for e in gpu.evictions]
    assert all(torch.equal(a.kept_columns, b.kept_columns) for a, b in zip(cpu.evictions, gpu.evictions))


def test_block_sparse_runs_in_waves(tiny64):
    model, tokenizer = tiny64
    engine = RolloutEngine(model, BlockSparsity(budget=8, page_size=4, dense_layers=1), record_evictions=True)
    assert not engine.refills_rows
    prompts, sampling = _prompts(), _sampling(tokenizer)
    with pytest.raises(ValueError, match="waves"):
        engine.generate(prompts, sampling, seeds=_seeds(7), max_rows=3)
    whole = engine.generate(prompts, sampling, seeds=_seeds(7))
    waves = schedule_rollouts(engine, prompts, SamplingConfig(**{**sampling.__dict__, "max_rows": 3}), _seeds(7))
    _same_samples(waves, whole)
    assert waves.kv.waves == 3


def test_no_new_tokens_gives_empty_responses(tiny64):
    model, tokenizer = tiny64
    batch = RolloutEngine(model).generate(_prompts(3), _sampling(tokenizer, new=0), seeds=_seeds(3))
    assert batch.response_ids.shape == (3, 0)


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o", "block"])
def test_a_groups_prompt_is_prefilled_once_and_samples_as_its_rows_alone(tiny64, sparsity):
    """Rows with the same prompt (a GRPO group) share one prefill; each samples what it samples alone (one row in
    flight: no group to share with), and the cache holds every row."""
    model, tokenizer = tiny64
    compression = None if sparsity == "dense" else \
        BlockSparsity(budget=6, page_size=2, dense_layers=0) if sparsity == "block" else _compression(sparsity)
    engine = RolloutEngine(model, compression, record_evictions=True)
    prompts = [p for p, size in zip(_prompts(3, seed=4), (3, 1, 4)) for _ in range(size)]
    grouped = engine.generate(prompts, _sampling(tokenizer), seeds=_seeds(len(prompts)))
    alone = RolloutEngine(model, compression, record_evictions=True, release_finished_rows=False)
    singles = [alone.generate([p], _sampling(tokenizer), seeds=[s]) for p, s in zip(prompts, _seeds(len(prompts)))]
    for row, single in enumerate(singles):
        length = int(single.response_lengths[0])
        assert grouped.response_lengths[row] == length
        assert torch.equal(grouped.response_ids[row, :length], single.response_ids[0, :length])
        assert (grouped.sampler_logprobs[row, :length] - single.sampler_logprobs[0, :length]).abs().max() <= 1e-6
    # The peak counts the cache of every row, not the one prefill a group shared: with one new token, nothing
    # grows after the prefill, and the rows hold at least the padded prompt each.
    first = engine.generate(prompts, _sampling(tokenizer, new=1), seeds=_seeds(len(prompts)))
    config = model.config
    per_slot = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size //
                                                                             config.num_attention_heads) * 8
    assert first.kv.kv_peak_bytes >= len(prompts) * WIDTH * per_slot


def test_the_window_of_queries_is_a_ring_holding_the_last_w_queries_of_every_cohort():
    """The provider's window: each static step's query overwrites the oldest at the device position, and a cohort that
    joins is turned to that position. Rolled back by the position, every row's window is its own last w queries,
    oldest first, as listed here by hand (with unreal slots where a row has fed fewer than w tokens)."""
    from types import SimpleNamespace

    from sparserl.rollout.engine.rollout_attention import RolloutAttention

    window, heads, dim = 3, 2, 4
    layer = SimpleNamespace(is_sliding=False, static_slots=None)
    cache = SimpleNamespace(layers=[layer], set_incoming=lambda columns, real: None)

    def prefill(rows: int, prompt: int, base: float) -> tuple[RolloutAttention, list[list[float]]]:
        provider = RolloutAttention(cache, window, keep_queries=True, keep_mass=False)
        provider.begin_forward(torch.arange(prompt).expand(rows, -1), torch.ones(rows, prompt, dtype=torch.bool))
        values = [[base + 10 * row + t for t in range(prompt)] for row in range(rows)]
        query = torch.tensor(values)[:, None, :, None].expand(rows, heads, prompt, dim).contiguous()
        layer.static_slots = None
        provider.observe(0, query, None, None)
        return provider, values

    def step(provider: RolloutAttention, fed: list[list[float]], value: float) -> None:
        layer.static_slots = object()
        rows = len(fed)
        provider.begin_step(SimpleNamespace(fed_real=torch.ones(rows, dtype=torch.bool)))
        new = [value + 10 * row for row in range(rows)]
        provider.observe(0, torch.tensor(new)[:, None, None, None].expand(rows, heads, 1, dim).contiguous(), None, None)
        provider.end_step()
        for row in range(rows):
            fed[row].append(new[row])

    def oldest_first(provider: RolloutAttention) -> tuple[torch.Tensor, torch.Tensor]:
        turn = -int(provider.ring_position)
        return provider.queries[0][:, 0, :, 0].roll(turn, dims=1), provider.window_real.roll(turn, dims=1)

    provider, fed = prefill(rows=2, prompt=2, base=100.0)  # a prompt shorter than the window: one unreal slot
    queries, real = oldest_first(provider)
    assert real.tolist() == [[False, True, True]] * 2
    assert queries[:, 1:].tolist() == [row[-2:] for row in fed]
    for t in range(4):  # once round the ring and one more
        step(provider, fed, 200.0 + t)
        queries, real = oldest_first(provider)
        assert queries.tolist() == [row[-window:] for row in fed] and bool(real.all())
    joining, joined = prefill(rows=1, prompt=5, base=500.0)
    provider.append_rows(joining)
    fed += joined
    step(provider, fed, 300.0)
    queries, real = oldest_first(provider)
    assert queries.tolist() == [row[-window:] for row in fed] and bool(real.all())
