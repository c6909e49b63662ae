"""The static decode step (`rollout/engine/step.py`): compiled whole with fullgraph=True (no graph break) it samples
what the eager step samples; replayed as captured graphs it does too; and it reads nothing back to the host, so the
decode loop's only reads between compressions are its end-of-row checks, every `check_every` steps."""

from __future__ import annotations

import warnings

import pytest
import torch
from capture_standin import model_tensors, restored, traced_graphs
from conftest import WRITE_SLOTS, compiled_static_write, make_tiny_model, static_write_layer

from sparserl.model.clock import HostReads
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine import decode_loop, step
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression

SPARSITY = {"dense": None, "rkv": KVCompression("rkv", budget=12, window=3, interval=3),
            "h2o": KVCompression("h2o", budget=12, window=3, interval=3, per_head=True),
            "block": BlockSparsity(budget=12, page_size=4, dense_layers=0)}


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = make_tiny_model(seed=7)
    return model, tokenizer


def _prompts(tokenizer, rows: int = 6) -> list[list[int]]:
    words = ["^abcdefgh|a", "^xyzw|x", "^qrstuvw|r"]
    return [tokenizer(words[r % len(words)]).input_ids for r in range(rows)]


def _generate(model, tokenizer, sparsity, compile_decode="false", max_rows=None, new=14, check_every=4):
    engine = RolloutEngine(model, sparsity, check_every=check_every, record_distributions=True)
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(new, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=max(map(len, prompts)), compile_decode=compile_decode)
    return engine, engine.generate(prompts, sampling, seeds=[request_seed(5, r) for r in range(len(prompts))],
                                   max_rows=max_rows)


def _same(a, b) -> None:
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5, rtol=0)
    assert a.kv.kv_peak_bytes == b.kv.kv_peak_bytes


@pytest.mark.parametrize("sparsity", ["dense", "rkv", pytest.param("h2o", marks=pytest.mark.slow),
                                      pytest.param("block", marks=pytest.mark.slow)])
def test_the_compiled_step_has_no_graph_break_and_samples_as_the_eager_one(tiny, sparsity):
    """`torch.compile(fullgraph=True, dynamic=False)` raises at the first graph break, so a rollout that runs compiled
    proves the step has none; its tokens are the eager step's and its log-probs agree to float rounding (the
    compiler fuses differently). Rows join mid-flight (`max_rows=4` of 6), so the rows and buffers change."""
    model, tokenizer = tiny
    torch._dynamo.reset()
    _, eager = _generate(model, tokenizer, SPARSITY[sparsity], "false", max_rows=None if sparsity == "block" else 4)
    engine, compiled = _generate(model, tokenizer, SPARSITY[sparsity], "true",
                                 max_rows=None if sparsity == "block" else 4)
    assert list(engine.runners) == ["compile"]
    _same(eager, compiled)
    if sparsity == "rkv":
        assert compiled.kv.compressions > 0


def _replayed_on_the_cpu(model, tokenizer, monkeypatch, sparsity=None, max_rows=None):
    """A rollout whose steps are captured and replayed by traced graphs (`capture_standin.py`)."""
    with traced_graphs(monkeypatch, model_tensors(model)) as (graphs, met):
        engine = RolloutEngine(model, sparsity, record_distributions=True)
        engine.runners["eager"] = step.StepRunner("graphs")  # what "auto" runs on the CPU, replaced
        prompts = _prompts(tokenizer)
        sampling = SamplingConfig(14, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  prompt_width=max(map(len, prompts)))
        batch = engine.generate(prompts, sampling, seeds=[request_seed(5, r) for r in range(len(prompts))],
                                max_rows=max_rows)
    return batch, graphs, met


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o", "block"])
def test_replayed_captures_sample_as_the_eager_step(tiny, monkeypatch, sparsity):
    """The graph runner's bookkeeping, replayed on the CPU by traced graphs (`capture_standin.py`: what the capture
    read on the host frozen in): one capture per set of buffers (rows joining and leaving, buffers growing make new
    ones), every tensor the step reads in its key, every replay on the tensors at its capture's addresses, the
    warm-up's writes undone or rewritten by the replay, and the rollout the eager one token for token."""
    model, tokenizer = tiny
    rows = None if sparsity == "block" else 3
    _, eager = _generate(model, tokenizer, SPARSITY[sparsity], "false", max_rows=rows)
    replayed, graphs, met = _replayed_on_the_cpu(model, tokenizer, monkeypatch, SPARSITY[sparsity], rows)
    assert 1 < len(graphs) == len(set(met)) < 14  # captured again when the buffers changed, not at every step
    assert torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)
    torch.testing.assert_close(eager.sampler_distribution, replayed.sampler_distribution, atol=0, rtol=0)


def test_a_step_that_reads_a_host_integer_replays_what_its_capture_read(tiny, monkeypatch):
    """The stand-in bites: a step that indexes by a Python integer the loop advances (here it records each drawn token
    a second time, at the response index the cache's length in slots gives on the host) is the real step eagerly,
    token for token, but a graph replays the index its capture read, so the replayed rollout records its tokens at
    stale indices. The real step, replayed the same way, is the eager rollout (the test above)."""
    model, tokenizer = tiny
    real_step = step.decode_step

    def step_reading_the_host(model, cache, provider, rows, out, sampling, keyword, generator=None):
        # Every row is admitted at once and none evicts: each holds the prompt's width and one slot per token fed.
        index = cache.layers[0].length - sampling.prompt_width + 1
        real_step(model, cache, provider, rows, out, sampling, keyword, generator)
        out.ids[rows.requests, index] = rows.tokens

    _, eager = _generate(model, tokenizer, None)
    monkeypatch.setattr(step, "decode_step", step_reading_the_host)
    _, broken_eager = _generate(model, tokenizer, None)
    assert torch.equal(eager.response_ids, broken_eager.response_ids)  # eagerly the host's index is the rows' own
    broken_replayed, graphs, met = _replayed_on_the_cpu(model, tokenizer, monkeypatch)
    assert len(met) > len(graphs)  # some steps replayed a graph captured at an earlier step
    assert not torch.equal(eager.response_ids, broken_replayed.response_ids)


def test_a_graph_is_refused_over_a_tensor_outside_its_key_and_fails_once_its_tensors_moved():
    """The stand-in's address checks: a step that reads a tensor the runner does not hold (the key misses it) is not
    captured, and a graph whose tensors were replaced since its capture is not replayed, as a real one would read
    freed memory."""
    from capture_standin import TracedGraph

    counts, outside = torch.zeros(3), torch.ones(3)
    held = [counts]
    with pytest.raises(AssertionError, match="not in its key"):
        TracedGraph(lambda: counts.add_(outside), [counts], lambda: held, [])
    graph = TracedGraph(lambda: counts.add_(1.0), [counts], lambda: held, [])
    graph.replay()
    graph.replay()
    assert counts.tolist() == [2.0] * 3  # captured, not run, then replayed twice
    held[:] = [torch.zeros(3)]  # the buffers moved (`StepRunner` would have captured again)
    with pytest.raises(AssertionError, match="stale graph"):
        graph.replay()


@pytest.mark.parametrize("mask_heads", [1, 2], ids=["one-mask", "per-kv-head"])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_the_gpus_decode_attention_is_the_explicit_one(mask_heads, scaling):
    """`_decode_sdpa`, a decode query's attention on a GPU (one SDPA call, each KV head with its query group as a
    batch entry), is softmax(q·kᵀ·scale, masked)·v computed head by head in float64, and the CPU's explicit path:
    4 query heads over 2 KV heads, left padding, evicted slots, a mask per layer or per KV head."""
    from sparserl.model import attention

    generator = torch.Generator().manual_seed(0)
    rows, q_heads, kv_heads, keys, dim = 3, 4, 2, 9, 8
    query = torch.randn(rows, q_heads, 1, dim, generator=generator, dtype=torch.float64)
    key, value = torch.randn(2, rows, kv_heads, keys, dim, generator=generator, dtype=torch.float64)
    mask = torch.ones(rows, mask_heads, 1, keys, dtype=torch.bool)
    mask[0, :, :, :3] = False  # left padding
    mask[1, -1, :, [4, 6]] = False  # evicted (by the second KV head alone, where masks are per KV head)
    mask[2, :, :, [0, 5]] = False
    out = attention._decode_sdpa(query, key, value, mask, scaling)
    scale = scaling if scaling is not None else dim ** -0.5
    expected = torch.empty_like(query)
    for row in range(rows):
        for head in range(q_heads):
            kv = head // (q_heads // kv_heads)
            seen = mask[row, kv if mask_heads > 1 else 0, 0]
            scores = key[row, kv, seen] @ query[row, head, 0] * scale
            expected[row, head, 0] = scores.softmax(dim=0) @ value[row, kv, seen]
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grouped = query.reshape(rows, kv_heads, q_heads // kv_heads, dim)
    explicit = attention._explicit_attention(grouped, key, value, mask, scale, None).reshape(rows, q_heads, 1, dim)
    torch.testing.assert_close(out, explicit, atol=1e-12, rtol=0)


def test_the_compiled_cache_write_is_in_place():
    """The static step's cache write, compiled, writes the rows' slots into the buffers themselves: Inductor writes a
    scatter_ out of place (a new buffer of the whole cache, copied back), which on an H200 made the compiled step
    2.9x slower than the uncompiled one (docs/benchmarks.md). The generated code allocates no tensor of a buffer's
    shape, and the slots hold the tokens."""
    layer = static_write_layer()
    keys, values, allocations = compiled_static_write(layer)
    assert allocations and not [shape for shape in allocations if shape.startswith("4, 2, 1024")]
    for row, slot in enumerate(WRITE_SLOTS):
        assert torch.equal(layer.keys[row, :, slot], keys[row, :, 0])
        assert torch.equal(layer.values[row, :, slot], values[row, :, 0])
        assert layer.columns[row, :, slot].tolist() == [7 + row] * 2 and layer.real[row, :, slot].all()
    assert int(layer.real.sum()) == 4 * 2  # nothing but the four slots


class _RecordedStep:
    """A CPU stand-in for a CUDA graph whose replay runs what was recorded (`capture_standin.TracedGraph` traces the
    step under a dispatch mode, which torch.compile refuses)."""

    def __init__(self, run):
        self.replay, self.compiled = run, "compiled" in run.__code__.co_freevars


@pytest.mark.parametrize("limit", [64, 1])
def test_compiled_captures_sample_as_the_eager_step(tiny, monkeypatch, limit):
    """`compile_decode=true` on a GPU: the compiled step is what each capture records (here replayed on the CPU), so
    one replay runs the compiler's fused kernels; the tokens are the eager step's, the log-probs to float rounding.
    Past dynamo's limit of compilations (limit 1: a rollout of one row first, a size of one being specialised, so
    that the rollout of three rows is a second compilation) the capture warns once and records the step uncompiled.
    (The eager runner's fallback: tests/test_run_shapes.py.)"""
    model, tokenizer = tiny
    _, eager = _generate(model, tokenizer, SPARSITY["rkv"], "false", max_rows=3)
    graphs: list[_RecordedStep] = []

    def capture(run, state):
        with restored(state):
            run()  # the warm-up
        graphs.append(_RecordedStep(run))
        return graphs[-1]

    monkeypatch.setattr(step, "_capture", capture)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=limit), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        engine = RolloutEngine(model, SPARSITY["rkv"], record_distributions=True)
        runner = engine.runners["eager"] = step.StepRunner("compiled-graphs")  # what "true" runs on a GPU
        prompts = _prompts(tokenizer)
        sampling = SamplingConfig(14, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  prompt_width=max(map(len, prompts)))
        seeds = [request_seed(5, r) for r in range(len(prompts))]
        if limit == 1:
            engine.generate(prompts[:1], sampling, seeds=seeds[:1], max_rows=1)
        replayed = engine.generate(prompts, sampling, seeds=seeds, max_rows=3)
    torch._dynamo.reset()
    shape_warnings = [w for w in warned if "more step shapes" in str(w.message)]
    compiled = sum(graph.compiled for graph in graphs)
    if limit == 1:
        assert runner.mode == "graphs" and len(shape_warnings) == 1 and 1 <= compiled < len(graphs)
    else:
        assert runner.mode == "compiled-graphs" and not shape_warnings and compiled == len(graphs) > 1
    _same(eager, replayed)


class _HostReadsByPhase(HostReads):
    """The host reads, by the loop's phase they ran in."""

    def __init__(self):
        super().__init__()
        self.phase = "loop"
        self.by_phase: dict[str, int] = {}

    def on_read(self) -> None:
        self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + 1


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o", "block"])
def test_no_host_read_inside_a_step_and_one_check_every_k_steps(tiny, monkeypatch, sparsity):
    """Between compressions the decode loop reads the device only at its end-of-row checks (one every `check_every`
    steps, and when a cohort reaches its length limit); the step itself reads nothing."""
    model, tokenizer = tiny
    counter = _HostReadsByPhase()

    def in_phase(name, method):
        def run(*args, **kwargs):
            before, counter.phase = counter.phase, name
            try:
                return method(*args, **kwargs)
            finally:
                counter.phase = before
        return run

    for name in ("_admit", "_compress", "_release_finished"):
        monkeypatch.setattr(decode_loop.DecodeLoop, name, in_phase(name, getattr(decode_loop.DecodeLoop, name)))
    monkeypatch.setattr(step.StepRunner, "run", in_phase("step", step.StepRunner.run))
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):  # no operator on a CPU; on a GPU a copy to the host
        counter.on_read()
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    steps = []
    with counter:
        engine, batch = _generate(model, tokenizer, SPARSITY[sparsity], new=24, check_every=4)
        steps.append(int(batch.response_lengths.max()))
    counter.by_phase.pop("loop", None)  # the engine's own reading of the finished batch, after the loop
    assert counter.by_phase.get("step", 0) == 0
    assert set(counter.by_phase) <= {"_admit", "_compress", "_release_finished"}
    # A check is a read of how many rows still sample, then (when some leave) which.
    assert counter.by_phase.get("_release_finished", 0) <= 2 * (steps[0] // 4 + 2)
    if sparsity == "rkv":
        assert batch.kv.compressions > 0


def test_a_bad_compile_setting_is_refused():
    with pytest.raises(ValueError, match="compile_decode"):
        step.StepRunner.mode_for("yes", torch.device("cpu"))
    assert step.StepRunner.mode_for("auto", torch.device("cpu")) == "eager"
    assert step.StepRunner.mode_for("true", torch.device("cpu")) == "compile"
    assert step.StepRunner.mode_for("auto", torch.device("cuda")) == "graphs"
    assert step.StepRunner.mode_for("true", torch.device("cuda")) == "compiled-graphs"
    assert step.StepRunner.mode_for("false", torch.device("cuda")) == "eager"


def test_a_rope_that_depends_on_the_length_runs_eagerly_and_refuses_to_compile():
    """Dynamic NTK RoPE recomputes its frequencies on the host as the sequence grows (a branch on a tensor's value):
    under auto its steps run eagerly and sample, asked to compile they are refused in one line."""
    from sparserl.errors import ConfigError

    model, tokenizer = make_tiny_model(seed=3, max_position_embeddings=14,
                                       rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert step.StepRunner.for_model("auto", model).mode == "eager"
    engine, batch = _generate(model, tokenizer, None, "auto")
    assert list(engine.runners) == ["eager"] and int(batch.response_lengths.max()) > 0
    with pytest.raises(ConfigError, match="rotary embedding depends on the sequence length"):
        _generate(model, tokenizer, None, "true")


@pytest.fixture(scope="module")
def peaked():
    """The tiny model with peaked attention, so that a sparse draft differs from the dense model."""
    return make_tiny_model(seed=7, initializer_range=0.5)


def _speculative(peaked, draft: str, compile_decode: str, runner: step.StepRunner | None = None, gamma="3"):
    """A lossless rollout of the peaked tiny model."""
    from sparserl.rollout.speculative.drafts import WindowDraft
    from sparserl.rollout.speculative.sampler import SpeculativeSampler

    model, tokenizer = peaked
    settings = WindowDraft(budget=8, sink=2) if draft == "window" else BlockSparsity(budget=12, page_size=4,
                                                                                    dense_layers=0)
    prompts = _prompts(tokenizer)
    sampler = SpeculativeSampler(model, settings, draft_tokens=gamma)
    if runner is not None:
        sampler.runners[compile_decode] = runner
    sampling = SamplingConfig(16, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=max(map(len, prompts)), compile_decode=compile_decode)
    return sampler.generate(prompts, sampling, seeds=[request_seed(9, r) for r in range(len(prompts))])


@pytest.mark.parametrize("draft", ["window", "block"])
def test_the_speculative_samplers_steps_replay_as_their_eager_runs(peaked, monkeypatch, draft):
    """The lossless sampler's draft and verification steps run through the same static-step runner: replayed from
    captures (one per draft setting and per γ, kept while the rows stay, however γ moves), they sample what the eager
    steps sample, bit for bit."""
    eager = _speculative(peaked, draft, "false")
    assert eager.speculation.acceptance_rate < 1  # the draft differs from the dense model
    with traced_graphs(monkeypatch, model_tensors(peaked[0])) as (graphs, met):
        replayed = _speculative(peaked, draft, "auto", step.StepRunner("graphs"))
    assert graphs and len(graphs) == len(set(met))
    assert torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)


def test_a_speculative_round_whose_gamma_moves_replays_its_earlier_captures(peaked, monkeypatch):
    """Adaptive γ goes back and forth; each (step, γ) over the same rows is captured once and replayed after."""
    with traced_graphs(monkeypatch, model_tensors(peaked[0])) as (graphs, met):
        batch = _speculative(peaked, "window", "auto", step.StepRunner("graphs"), gamma="adaptive")
    verify = [key for run, key, _ in met if run.__name__ == "verify_step"]
    assert len(set(verify)) > 1 and len(verify) > len(set(verify))  # γ moved, and came back
    assert len(graphs) == len(set(met))
    assert batch.speculation.rounds > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["window", "block"])
def test_the_speculative_samplers_steps_compile_whole(peaked, draft):
    """Compiled with fullgraph=True (no graph break), the draft and verification steps sample the eager tokens; the
    log-probs agree to the compiler's float rounding (5.5e-5 at most seen on this peaked model). Slow: each γ and
    draft setting compiles (about two minutes)."""
    eager = _speculative(peaked, draft, "false")
    torch._dynamo.reset()
    compiled = _speculative(peaked, draft, "true")
    assert torch.equal(eager.response_ids, compiled.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, compiled.sampler_logprobs, atol=1e-4, rtol=1e-4)
