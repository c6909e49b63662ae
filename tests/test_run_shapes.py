"""The static step over a whole run (`rollout/engine/step.py`, `participants.py`): compiled once for every size of
rows and cache it meets, whatever rollout meets it; what compiling and capturing cost counted per rollout; the cache's
growth, and so KV saved, the same however the step runs; the weights updated in place, so that a compiled (or
captured) step reads the new ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_tiny_model

from sparserl.rollout.batch import KVStats, SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.dispatch.spec import SamplerCache, SamplerSpec
from sparserl.rollout.engine import step
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

WORDS = ["^abcdefgh|a", "^xyzw|x", "^qrstuvw|r", "^mnop|m"]
RKV = KVCompression("rkv", budget=12, window=3, interval=3)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model(seed=7)


def _rollout(sampler, tokenizer, rollout: int, compile_decode: str, max_rows: int = 3):
    """Rollout `rollout` of a run: its own prompts, count and seeds (so its rows, requests and lengths differ from
    the others'), at most `max_rows` rows at a time, so that rows leave and join."""
    prompts = [tokenizer(WORDS[(row + rollout) % len(WORDS)]).input_ids for row in range(5 + rollout % 3)]
    sampling = SamplingConfig(12 + 2 * rollout, 1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, prompt_width=12, compile_decode=compile_decode)
    seeds = [request_seed(rollout, row) for row in range(len(prompts))]
    return sampler.generate(prompts, sampling, seeds=seeds, max_rows=max_rows)


def test_a_run_compiles_its_step_at_most_twice_and_says_what_it_cost(tiny):
    """Rows leaving and joining, the cache growing and compressed, rollouts of other request counts and lengths, and a
    KV budget that moves (a new sampler): the step compiles once over symbolic sizes, and at most once more for a
    size of one, counted by dynamo's own compile hook; every rollout's `KVStats` says what it compiled, and the
    rollouts after the first compile nothing."""
    model, tokenizer = tiny
    torch._dynamo.reset()
    compiled: list[str] = []
    hook = torch._dynamo.callback.callback_handler.register_start_callback(
        lambda args: compiled.append("step"))
    samplers = SamplerCache(model)
    try:
        stats = []
        for rollout in range(4):
            budget = 12 if rollout < 2 else 10  # a budget controller moved: a new sampler, the same runners
            spec = SamplerSpec(sparsity=dataclasses.replace(RKV, budget=budget), record_evictions=False)
            stats.append(_rollout(samplers.get(spec), tokenizer, rollout, "true").kv)
    finally:
        torch._dynamo.callback.callback_handler.remove_start_callback(hook)
        torch._dynamo.reset()
    assert 1 <= len(compiled) <= 2
    assert sum(s.step_compilations for s in stats) == len(compiled)
    assert [s.step_compilations for s in stats[2:]] == [0, 0]
    assert stats[0].step_compile_seconds > 0 and not any(s.step_fallbacks for s in stats)
    assert sum(s.compressions for s in stats) > 0


def test_every_captured_graph_is_counted_with_its_seconds(tiny, monkeypatch):
    """A rollout's `step_captures` are the captures the runner made (counted here by the stand-in capture itself),
    and they took time; an eager rollout captures nothing."""
    model, tokenizer = tiny
    captured = []

    def capture(run, state):
        saved = [t.clone() for t in state]
        run()  # the warm-up a capture takes, undone
        for tensor, copy in zip(state, saved):
            tensor.copy_(copy)
        captured.append(run)
        return type("Recorded", (), {"replay": staticmethod(run)})

    monkeypatch.setattr(step, "_capture", capture)
    engine = RolloutEngine(model, RKV, record_evictions=False)
    engine.runners["eager"] = step.StepRunner("graphs")  # what auto runs on a GPU
    replayed = _rollout(engine, tokenizer, 0, "auto").kv
    assert replayed.step_captures == len(captured) > 1 and replayed.step_capture_seconds > 0
    assert replayed.step_compilations == 0
    eager = _rollout(RolloutEngine(model, RKV, record_evictions=False), tokenizer, 0, "false").kv
    assert eager.step_captures == eager.step_compilations == 0


def test_step_counts_add_up_over_shards():
    """Shards' and waves' counts add up, as compressions do."""
    parts = [KVStats(step_compilations=1, step_compile_seconds=2.0, step_captures=3, step_capture_seconds=0.5,
                     step_fallbacks=0),
             KVStats(step_compilations=0, step_compile_seconds=0.0, step_captures=4, step_capture_seconds=0.25,
                     step_fallbacks=1)]
    merged = KVStats.merged(parts, [2, 2])
    assert (merged.step_compilations, merged.step_captures, merged.step_fallbacks) == (1, 7, 1)
    assert merged.step_compile_seconds == 2.0 and merged.step_capture_seconds == 0.75


def _peaks_by_mode(model, prompts, sampling, sparsity, monkeypatch, **engine_settings) -> tuple[dict, object]:
    """The measured KV peak of the same rollout run eagerly and through captured graphs (a stand-in that runs the
    step), and the eager batch."""
    monkeypatch.setattr(step, "_capture", lambda run, state: type("Eager", (), {"replay": staticmethod(run)}))
    peaks, batches = {}, {}
    for mode in ("eager", "graphs"):
        engine = RolloutEngine(model, sparsity, record_evictions=False, **engine_settings)
        engine.runners["eager"] = step.StepRunner(mode)
        batches[mode] = engine.generate(prompts, sampling, seeds=[request_seed(3, row) for row in range(len(prompts))])
        peaks[mode] = batches[mode].kv.kv_peak_bytes
    assert torch.equal(batches["eager"].response_ids, batches["graphs"].response_ids)
    return peaks, batches["eager"]


def _slot_bytes(model) -> int:
    """KV bytes of one token in one row, every layer (float32 keys and values)."""
    config = model.config
    return 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4 \
        * config.num_hidden_layers


@pytest.mark.parametrize("sparsity", [None, RKV])
def test_kv_peak_is_one_figure_whatever_the_step_mode(tiny, monkeypatch, sparsity):
    """The cache grows by the same ladder eagerly and captured, so the measured peak (what KV saved divides by) is
    one figure. For the dense cache of a static batch (every row stays to the end) it is worked out here by hand: 12
    prompt slots and up to 40 new tokens make 52, an eighth of which is 16 in whole quanta of 16, so the buffers hold
    16, 32, 48 or 52 slots, the first of those that holds the prompt and every token fed (the longest response but
    its last token)."""
    model, tokenizer = tiny
    prompts = [tokenizer(WORDS[row % len(WORDS)]).input_ids for row in range(6)]
    sampling = SamplingConfig(40, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=12)
    peaks, batch = _peaks_by_mode(model, prompts, sampling, sparsity, monkeypatch, release_finished_rows=False)
    assert peaks["eager"] == peaks["graphs"]
    if sparsity is None:
        fed = 12 + int(batch.response_lengths.max()) - 1
        slots = next(rung for rung in (16, 32, 48, 52) if rung >= fed)
        assert peaks["eager"] == 6 * slots * _slot_bytes(model)


def test_a_captured_dense_rollout_grows_its_cache_as_finely_as_an_eager_one(tiny, monkeypatch):
    """Rows that end early leave (token 39 ends this tiny model's rows at 10-40 tokens): the peak is six rows at
    32 slots, reached eagerly and captured alike, where a cache sized for graphs at once (the whole 52-slot sequence
    for the six rows) would read as a dense peak 1.6 times as large and inflate KV saved."""
    model, tokenizer = tiny
    prompts = [tokenizer(WORDS[row % len(WORDS)]).input_ids for row in range(6)]
    sampling = SamplingConfig(40, 1.0, eos_token_id=39, pad_token_id=tokenizer.pad_token_id, prompt_width=12)
    peaks, batch = _peaks_by_mode(model, prompts, sampling, None, monkeypatch)
    assert int(batch.response_lengths.min()) < 16  # rows ended early and left
    assert peaks["eager"] == peaks["graphs"] < 6 * 52 * _slot_bytes(model)


def test_weight_updates_are_in_place_so_the_compiled_step_reads_the_new_weights(tiny):
    """The learner's optimizer step and the Ray workers' `load_state_dict` write the weights in place (their
    addresses are what a captured graph holds); the compiled step, compiled over the old weights, then samples what
    the eager step samples with the new ones."""
    model, tokenizer = make_tiny_model(seed=11)
    engine = RolloutEngine(model, None, record_evictions=False)
    torch._dynamo.reset()
    before = _rollout(engine, tokenizer, 0, "true")  # compiled over the first weights
    addresses = [p.data_ptr() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.zero_grad()
    model(input_ids=torch.tensor([tokenizer(WORDS[0]).input_ids])).logits.float().pow(2).mean().backward()
    optimizer.step()
    other, _ = make_tiny_model(seed=12)
    model.load_state_dict({name: (value + other.state_dict()[name]) / 2 for name, value in model.state_dict().items()})
    assert [p.data_ptr() for p in model.parameters()] == addresses
    compiled = _rollout(engine, tokenizer, 0, "true")
    torch._dynamo.reset()
    eager = _rollout(RolloutEngine(model, None, record_evictions=False), tokenizer, 0, "false")
    assert compiled.kv.step_compilations == 0  # the same compilation, run over the new weights
    assert not torch.equal(compiled.sampler_logprobs, before.sampler_logprobs)  # the weights did change
    assert torch.equal(compiled.response_ids, eager.response_ids)
    torch.testing.assert_close(compiled.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)


def test_the_participants_declare_every_dim_that_changes_within_a_rollout(tiny, monkeypatch):
    """Whatever dim of a step's tensors changes from one step to another (rows leaving and joining, the cache growing
    and shrinking after a compression) is one its participant declares varying, so one compilation serves the run;
    a dim declared varying that never changes would only cost a symbolic size."""
    model, tokenizer = tiny
    calls = []
    run = step.StepRunner.run

    def recorded(self, step_function, args, buffers, state, key=(), varying=()):
        declared = {id(tensor): set(dims) for tensor, dims in varying}
        calls.append([(tuple(t.shape), declared.get(id(t), set())) for t in (*buffers, *state) if t is not None])
        return run(self, step_function, args, buffers, state, key, varying)

    monkeypatch.setattr(step.StepRunner, "run", recorded)
    _rollout(RolloutEngine(model, RKV, record_evictions=False), tokenizer, 2, "false")
    assert len({len(call) for call in calls}) == 1  # the same tensors at every step
    changed = set()
    for before, after in zip(calls, calls[1:]):
        for (shape, _), (new_shape, declared) in zip(before, after):
            moved = {dim for dim, (a, b) in enumerate(zip(shape, new_shape)) if a != b}
            assert moved <= declared, f"{shape} -> {new_shape}: dims {moved - declared} change undeclared"
            changed |= {(dim, len(shape)) for dim in moved}
    assert changed  # rows left and joined, the cache grew: something did change


def test_a_fallback_lasts_the_run_and_the_metrics_say_so(tiny):
    """Past dynamo's limit of compilations (1 here: one row left of two is a second compilation, a size of one being
    specialised), the step runs eagerly for the rest of the run: the runner warns once, the rollout that fell back
    counts it in its `KVStats`, and the next rollout, still eager, compiles nothing and samples the eager tokens."""
    model, tokenizer = tiny
    engine = RolloutEngine(model, RKV, record_evictions=False)
    prompts = [tokenizer(WORDS[row % len(WORDS)]).input_ids for row in range(4)]
    seeds = [request_seed(1, row) for row in range(4)]

    def sample(compile_decode: str, sampler=engine):
        sampling = SamplingConfig(10, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  prompt_width=12, compile_decode=compile_decode)
        return sampler.generate(prompts, sampling, seeds=seeds, max_rows=2)

    torch._dynamo.reset()
    # config.patch, not monkeypatch: monkeypatch's undo left dynamo's config without the field for the next tests.
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            with pytest.warns(RuntimeWarning, match="the rest of this run's steps run eagerly"):
                fell_back = sample("true").kv
            after = sample("true")
    finally:
        torch._dynamo.reset()
    assert fell_back.step_fallbacks == 1 and after.kv.step_fallbacks == after.kv.step_compilations == 0
    assert engine.runners["compile"].mode == "eager"
    eager = sample("false", RolloutEngine(model, RKV, record_evictions=False))
    assert torch.equal(after.response_ids, eager.response_ids)
