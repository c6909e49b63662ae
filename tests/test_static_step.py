"""The static decode step (`rollout/engine/step.py`): compiled whole with fullgraph=True (no graph break) it samples
what the eager step samples; replayed as captured graphs it does too; and it reads nothing back to the host, so the
decode loop's only reads between compressions are its end-of-row checks, every `check_every` steps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine import decode_loop, step
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression

# Reading a tensor's value on the host: on a GPU each waits for the device's queue.
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
              "aten.is_nonzero.default", "aten.equal.default"}
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


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o", "block"])
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


class _ReplayedGraph:
    """What a CUDA graph does, on the CPU: the capture records the step without running it, a replay runs it."""

    def __init__(self):
        self.step = None

    def replay(self):
        self.step()


@contextlib.contextmanager
def _graphs_on_the_cpu(monkeypatch):
    graphs = []

    def capture(run, state):
        saved = [(tensor, tensor.clone()) for tensor in state]
        run()  # the warm-up: a real step, whose effects on the state the capture must undo
        for tensor, copy in saved:
            tensor.copy_(copy)
        graph = _ReplayedGraph()
        graph.step = run
        graphs.append(graph)
        return graph

    monkeypatch.setattr(step, "_capture", capture)
    yield graphs


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o", "block"])
def test_replayed_captures_sample_as_the_eager_step(tiny, monkeypatch, sparsity):
    """The graph runner's bookkeeping, replayed on the CPU: one capture per set of buffers (rows joining and leaving,
    buffers growing make new ones), the warm-up's effects undone, and the rollout the eager one token for token."""
    model, tokenizer = tiny
    rows = None if sparsity == "block" else 3
    _, eager = _generate(model, tokenizer, SPARSITY[sparsity], "false", max_rows=rows)
    with _graphs_on_the_cpu(monkeypatch) as graphs:
        engine = RolloutEngine(model, SPARSITY[sparsity], record_distributions=True)
        engine.runners["eager"] = step.StepRunner("graphs")  # what "auto" runs on the CPU, replaced
        prompts = _prompts(tokenizer)
        sampling = SamplingConfig(14, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  prompt_width=max(map(len, prompts)))
        replayed = engine.generate(prompts, sampling, seeds=[request_seed(5, r) for r in range(len(prompts))],
                                   max_rows=rows)
    assert 1 < len(graphs) < 14  # captured again when the buffers changed, not at every step
    assert torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)
    torch.testing.assert_close(eager.sampler_distribution, replayed.sampler_distribution, atol=0, rtol=0)


class _HostReads(TorchDispatchMode):
    """Counts the operators that read a tensor's value on the host, by the loop's phase they ran in."""

    def __init__(self):
        super().__init__()
        self.phase = "loop"
        self.reads: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            self.reads[self.phase] = self.reads.get(self.phase, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sparsity", ["dense", "rkv"])
def test_no_host_read_inside_a_step_and_one_check_every_k_steps(tiny, monkeypatch, sparsity):
    """Between compressions the decode loop reads the device only at its end-of-row checks (one every `check_every`
    steps, and when a cohort reaches its length limit); the step itself reads nothing."""
    model, tokenizer = tiny
    counter = _HostReads()

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
    steps = []
    with counter:
        engine, batch = _generate(model, tokenizer, SPARSITY[sparsity], new=24, check_every=4)
        steps.append(int(batch.response_lengths.max()))
    counter.reads.pop("loop", None)  # the engine's own reading of the finished batch, after the loop
    assert counter.reads.get("step", 0) == 0
    assert set(counter.reads) <= {"_admit", "_compress", "_release_finished"}
    # A check is a read of how many rows still sample, then (when some leave) which.
    assert counter.reads.get("_release_finished", 0) <= 2 * (steps[0] // 4 + 2)
    if sparsity == "rkv":
        assert batch.kv.compressions > 0


def test_a_bad_compile_setting_is_refused():
    with pytest.raises(ValueError, match="compile_decode"):
        step.StepRunner.for_device("yes", torch.device("cpu"))
    assert step.StepRunner.for_device("auto", torch.device("cpu")).mode == "eager"
    assert step.StepRunner.for_device("true", torch.device("cpu")).mode == "compile"
    assert step.StepRunner.for_device("auto", torch.device("cuda")).mode == "graphs"
    assert step.StepRunner.for_device("false", torch.device("cuda")).mode == "eager"


def _speculative(draft: str, compile_decode: str, runner: step.StepRunner | None = None):
    """A lossless rollout of the tiny model (peaked attention, so that the draft differs from the dense model)."""
    from sparserl.rollout.speculative.drafts import WindowDraft
    from sparserl.rollout.speculative.sampler import SpeculativeSampler

    model, tokenizer = make_tiny_model(seed=7, initializer_range=0.5)
    settings = WindowDraft(budget=8, sink=2) if draft == "window" else BlockSparsity(budget=12, page_size=4,
                                                                                    dense_layers=0)
    prompts = _prompts(tokenizer)
    sampler = SpeculativeSampler(model, settings, draft_tokens=3)
    if runner is not None:
        sampler.runners[compile_decode] = runner
    sampling = SamplingConfig(16, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=max(map(len, prompts)), compile_decode=compile_decode)
    return sampler.generate(prompts, sampling, seeds=[request_seed(9, r) for r in range(len(prompts))])


@pytest.mark.parametrize("draft", ["window", "block"])
def test_the_speculative_samplers_steps_replay_as_their_eager_runs(monkeypatch, draft):
    """The lossless sampler's draft and verification steps run through the same static-step runner: replayed from
    captures (one per draft setting and per γ), they sample what the eager steps sample, bit for bit."""
    eager = _speculative(draft, "false")
    assert eager.speculation.acceptance_rate < 1  # the draft differs from the dense model
    with _graphs_on_the_cpu(monkeypatch) as graphs:
        replayed = _speculative(draft, "auto", step.StepRunner("graphs"))
    assert graphs and torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["window", "block"])
def test_the_speculative_samplers_steps_compile_whole(draft):
    """Compiled with fullgraph=True (no graph break), the draft and verification steps sample the eager tokens; the
    log-probs agree to the compiler's float rounding (5.5e-5 at most seen on this peaked model). Slow: each γ and
    draft setting compiles (about two minutes)."""
    eager = _speculative(draft, "false")
    torch._dynamo.reset()
    compiled = _speculative(draft, "true")
    assert torch.equal(eager.response_ids, compiled.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, compiled.sampler_logprobs, atol=1e-4, rtol=1e-4)
