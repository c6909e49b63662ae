"""One static decode step: the rows' tokens in, the next tokens and their log-probs out, over fixed-shape buffers.

The decode loop (`decode_loop.py`) decides; the step computes. Between two compressions every decode step of a rollout
is this one function of device tensors updated in place: the token each row feeds, its position, column, cache slot and
realness, its draw counter (`step_state.RowState`), the cache buffers (`BufferLayer.static_slots`), the policies' window
of queries and attention mass, and the per-request outputs (`step_state.Responses`). Its masks come from the cache's
realness and columns inside the step; nothing in it reads a value back to the host, indexes by a boolean mask or
branches on a tensor's value, and no shape changes from one step to the next. So it can be captured as one CUDA graph
per (rows, cache capacity) and replayed (`StepRunner`, as vLLM does), compiled whole (`torch.compile(fullgraph=True)`,
once over symbolic rows and capacity), or both, the compiled step captured: the loop only calls it between the events
that change a shape (rows joining or leaving, a buffer growing, a compression). What the step reads and advances comes
from its participants, each under one contract (`participants.py`).

Each row draws the token at its own response index from its own seed (`token_draws.row_uniforms`), so a row's tokens
do not depend on the rows beside it, and the step's outputs are the eager step's whether it runs eagerly, compiled
or replayed (tests/test_static_step.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from ...errors import ConfigError
from ...model.structure import rope_depends_on_length, text_config
from ..arena import StepArena
from .participants import Varying, mark_varying, step_buffers, step_key, step_state, varying_dims
from .step_state import Responses, RowState
from .token_draws import draw_tokens, row_uniforms

COMPILE_CHOICES = ("auto", "true", "false")
MODES = ("eager", "compile", "graphs", "compiled-graphs")
# One torch.compile of each step function for the whole process: dynamo keeps its compilations per function and
# per torch.compile call, so a runner of its own for every sampler (an evaluation's engine, a sampler rebuilt when
# a budget moves) would compile the step again, up to dynamo's limit of compilations per function.
_COMPILED_STEPS: dict[Callable, Callable] = {}
# Graphs a runner keeps across rollouts (`StepRunner._kept`), the least recently replayed dropped past it: a run
# meets a few hundred (rows, capacity) pairs at most (docs/benchmarks.md), and all share one memory pool.
KEPT_GRAPHS = 512
# The memory pool every captured step allocates its intermediates from, as vLLM's graphs share one: a step writes its
# results in place, so nothing it allocates outlives its replay, and steps replay one at a time.
_GRAPH_POOL: tuple | None = None


def draw_and_record(logits: torch.Tensor, rows: RowState, out: Responses, sampling, own: torch.Tensor,
                    generator: torch.Generator | None = None) -> None:
    """Draw each row's token at its response index `own [N]` from `logits [N, V]`, record it for its request, and
    leave it in `rows` as the token to feed. A row that is no longer live draws padding, recorded as nothing; the EOS
    token itself is real (fed and cached), and so is a row's last token before its length limit."""
    draws = row_uniforms(rows.seeds, own) if rows.seeds is not None else None
    token, token_logprob, step_logp = draw_tokens(logits, sampling.temperature, generator, draws)
    requests = rows.requests
    fed_real = out.live[requests]
    token = torch.where(fed_real, token, sampling.pad_token_id)
    out.ids.index_put_((requests, own), token)
    out.logprobs.index_put_((requests, own), torch.where(fed_real, token_logprob, 0.0))
    if out.distributions is not None:
        out.distributions.index_put_((requests, own), step_logp)
    out.lengths.index_put_((requests,), out.lengths[requests] + fed_real.long())
    # The length limit T read from the outputs' shape, not `sampling`: a compiled step keeps it symbolic, where a
    # Python int would be a constant that a rollout of another length compiles again.
    still = fed_real & (own < out.ids.shape[1] - 1)
    if sampling.eos_token_id is not None:
        hit_eos = fed_real & (token == sampling.eos_token_id)
        out.ended.index_put_((requests,), out.ended[requests] | hit_eos)
        still = still & ~hit_eos
    out.live.index_put_((requests,), still)
    rows.tokens.copy_(token)
    rows.fed_real.copy_(fed_real)
    rows.counters.copy_(own)


def decode_step(model, cache, provider, rows: RowState, out: Responses, sampling, cache_keyword: str,
                generator: torch.Generator | None = None) -> None:
    """Feed each row's token, draw the next one, record it and advance `rows` (see the module), under the caller's
    `masked_attention(model, provider)`. The caller has made room for one more slot in every row
    (`BufferCache.reserve`) and counts it afterwards (`BufferCache.advance`)."""
    cache.begin_step(rows)
    provider.begin_step(rows)
    logits = model(input_ids=rows.tokens[:, None], position_ids=rows.positions[:, None],
                   **{cache_keyword: cache}, use_cache=True).logits[:, -1]
    cache.end_step()
    provider.end_step()
    out.fed.index_put_((rows.requests,), out.fed[rows.requests] + rows.fed_real.long())
    draw_and_record(logits, rows, out, sampling, rows.counters + 1, generator)
    rows.end_step()


@dataclass
class StepCounts:
    """What running the static steps cost beyond the steps themselves: compilations (one per step function and set
    of guards dynamo meets), CUDA graph captures, the seconds each took, and fallbacks (a runner that met more shapes
    than dynamo keeps compiled runs the rest of the run uncompiled, `StepRunner`)."""

    compilations: int = 0
    compile_seconds: float = 0.0
    captures: int = 0
    capture_seconds: float = 0.0
    fallbacks: int = 0

    def since(self, before: StepCounts) -> StepCounts:
        """What was counted after `before` (a copy of these counts taken earlier)."""
        return StepCounts(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


class StepRunner:
    """Runs a static step (`decode_step`, the speculative sampler's draft and verification steps): eagerly, compiled
    or replayed from CUDA graphs, each captured on the first call that meets its key (the step, the Python values
    that shape it, the addresses and shapes of every tensor it reads and writes). A graph whose tensors all lie in
    the runner's arena (`rollout/arena.py`, where the decode loop places its rows, outputs, windows and cache when
    its steps are captured) is kept for the rest of the run, and replayed by a later rollout that meets the same
    shapes; any other is dropped once the buffers it holds are replaced, and at the end of its rollout
    (`one_rollout`), so that a run's captures are counted per shape, not per rollout. Compilations are the process's
    (`_COMPILED_STEPS`), so they last the run whichever sampler runs the step; a runner serves the whole run too (the
    dispatch's `SamplerCache` keeps it across samplers), so a fallback lasts the run and is counted.

    Compiled (`torch.compile(fullgraph=True)`, the CPU's proof that the step has no graph break), the dims that
    change within a run (rows in flight, cache capacity, requests: the participants' `varying_dims`) are symbolic,
    so a step function compiles once for every size, and again at most for a size of one, which dynamo
    specialises.

    `mode`: "eager", "compile", "graphs" or "compiled-graphs" (compiled, then the compiled step captured, so that
    one replay launches the compiler's fused kernels); `compile_decode` (auto | true | false) chooses: auto is graphs
    on CUDA, eager elsewhere; true is compiled-graphs on CUDA and compile elsewhere. `counts`: what compiling and
    capturing cost so far (`StepCounts`)."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"step mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.counts = StepCounts()
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # this rollout's, over tensors outside the arena
        # Graphs over the arena's tensors only, kept across rollouts (oldest use first), while its storages stay put.
        self._kept: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self.arena = StepArena() if mode in ("graphs", "compiled-graphs") else None
        self._weights: tuple = ()  # where this rollout's models keep their weights (`one_rollout`)

    @staticmethod
    def mode_for(compile_decode: str, device: torch.device) -> str:
        if compile_decode not in COMPILE_CHOICES:
            raise ValueError(f"compile_decode {compile_decode!r}: one of {', '.join(COMPILE_CHOICES)}")
        if compile_decode == "false":
            return "eager"
        if device.type == "cuda":
            return "compiled-graphs" if compile_decode == "true" else "graphs"
        return "compile" if compile_decode == "true" else "eager"

    @classmethod
    def for_model(cls, compile_decode: str, model) -> StepRunner:
        """The runner for `model`'s steps on its device. A rotary embedding that depends on the sequence length
        (dynamic NTK, LongRoPE) recomputes its frequencies on the host as a sequence grows, which no graph can hold:
        such a model's steps run eagerly under auto, and `true` is refused."""
        mode = cls.mode_for(compile_decode, next(model.parameters()).device)
        if mode != "eager" and rope_depends_on_length(text_config(model)):
            if compile_decode == "true":
                raise ConfigError("compile_decode true: this model's rotary embedding depends on the sequence length "
                                  "(dynamic NTK or LongRoPE), so its decode step cannot be compiled or captured; use "
                                  "auto or false")
            mode = "eager"
        return cls(mode)

    @property
    def kept_graphs(self) -> int:
        """Graphs kept for later rollouts."""
        return len(self._kept)

    def release(self) -> None:
        """Drop this rollout's graphs over tensors outside the arena (they hold the rollout's buffers); those over the
        arena's stay for the next rollout."""
        self._graphs.clear()

    @contextlib.contextmanager
    def one_rollout(self, *models: torch.nn.Module) -> Iterator[StepCounts]:
        """A rollout of `models` (the weights its steps read) through the runner: yields what it will have cost
        (`StepCounts`, filled in when it ends), and drops its graphs outside the arena when it ends or fails. The
        weights' addresses are part of every graph's key: a graph kept from an earlier rollout replays only over
        weights that moved in place (an optimizer step, `load_state_dict`), never over replaced ones."""
        self._weights = tuple(t.data_ptr() for model in models for t in (*model.parameters(), *model.buffers()))
        before, made = dataclasses.replace(self.counts), StepCounts()
        try:
            yield made
        finally:
            self.release()
            for name, value in vars(self.counts.since(before)).items():
                setattr(made, name, value)

    def run(self, step: Callable, args: tuple, buffers: list[torch.Tensor], state: list[torch.Tensor],
            key: tuple = (), varying: Varying = ()) -> None:
        """`step(*args)`, which reads and writes `buffers` (writing the same values if run twice, as a cache's slots)
        and advances `state` (counters, windows, outputs: restored after the warm-up a capture needs). `key`: the
        Python values the step's work depends on; `varying`: the dims that change size within a run, which a
        compilation keeps symbolic."""
        if self.mode == "eager":
            step(*args)
            return
        if self.mode in ("compile", "compiled-graphs"):
            mark_varying(varying)
        if self.mode == "compile":
            self._run_compiled(step, args)
        else:
            self._replay(step, args, buffers, state, key)

    @staticmethod
    def _compiled_step(step: Callable) -> Callable:
        if step not in _COMPILED_STEPS:
            _COMPILED_STEPS[step] = torch.compile(step, fullgraph=True, dynamic=None)
        return _COMPILED_STEPS[step]

    def _counting_compilations(self, run: Callable[[], None]) -> None:
        """`run()`, counting the compilations it made and the seconds of the calls that made one. Sizes equal at
        compile time stay distinct symbols (no duck shaping): rows that happen to equal the requests must not make
        a guard that the next rollout fails."""
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            run()
        made = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        if made:
            self.counts.compilations += made
            self.counts.compile_seconds += time.perf_counter() - started

    def _run_compiled(self, step: Callable, args: tuple) -> None:
        try:
            self._counting_compilations(lambda: self._compiled_step(step)(*args))
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self._past_recompile_limit("eager", stacklevel=4)
            step(*args)

    def _replay(self, step, args, buffers, state, key) -> None:
        tensors = [t for t in (*buffers, *state) if t is not None]
        # The dtype too: samplers sharing the runner (a run's evaluation and its fp8 sampler) place other dtypes at
        # the same addresses.
        held = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)
        full_key = (step, key, held, self._weights)
        graph = self._kept.get(full_key)
        if graph is not None:
            self._kept.move_to_end(full_key)
        else:
            graph = self._graphs.get(full_key)
        if graph is None:
            # A graph of this step over other buffers reads tensors that no longer hold the rollout: drop it (one of
            # this step over these buffers with another key, a speculative round's γ, stays).
            for stale in [k for k in self._graphs if k[0] is step and k[2] != held]:
                del self._graphs[stale]
            started = time.perf_counter()
            graph = self._capture_step(step, args, [t for t in state if t is not None])
            if self.arena is not None and all(self.arena.holds(t) for t in tensors):
                self._kept[full_key] = graph
                if len(self._kept) > KEPT_GRAPHS:
                    self._kept.popitem(last=False)
            else:
                self._graphs[full_key] = graph
            self.counts.captures += 1
            self.counts.capture_seconds += time.perf_counter() - started
        graph.replay()

    def _capture_step(self, step: Callable, args: tuple, state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        if self.mode == "compiled-graphs":
            compiled = self._compiled_step(step)
            captured = []
            try:
                self._counting_compilations(lambda: captured.append(_capture(lambda: compiled(*args), state)))
                return captured[0]
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                self._past_recompile_limit("graphs", stacklevel=5)
        return _capture(lambda: step(*args), state)

    def _past_recompile_limit(self, fallback_mode: str, stacklevel: int) -> None:
        # Dynamo raises before the step runs (in a capture's warm-up, before it), so no state has moved and the rest
        # of the run goes on uncompiled: the same step, float rounding aside. Counted, so that the rollouts' metrics
        # say so (`KVStats.step_fallbacks`). `stacklevel` names `run`'s caller.
        how = "run eagerly" if fallback_mode == "eager" else "are captured uncompiled"
        warnings.warn(f"compile_decode: more step shapes than torch.compile keeps compiled; the rest of this "
                      f"run's steps {how}", RuntimeWarning, stacklevel=stacklevel)
        self.counts.fallbacks += 1
        self.mode = fallback_mode


def run_decode_step(runner: StepRunner, model, cache, provider, rows: RowState, out: Responses, sampling,
                    cache_keyword: str, generator: torch.Generator | None = None) -> None:
    """`decode_step` through `runner`, with the tensors its participants expose (`participants.py`)."""
    if rows.seeds is None:  # rows drawing from one generator: eagerly, outside any graph
        decode_step(model, cache, provider, rows, out, sampling, cache_keyword, generator)
        return
    participants = (cache, provider, rows, out)
    # What a graph freezes beside its tensors and weights: a kept graph is replayed by later rollouts, whose sampling
    # may differ (an evaluation's greedy draws after training's).
    frozen = (sampling.temperature, sampling.eos_token_id, sampling.pad_token_id, cache_keyword)
    runner.run(decode_step, (model, cache, provider, rows, out, sampling, cache_keyword), step_buffers(participants),
               step_state(participants), (*frozen, *step_key(participants)), varying_dims(participants))


def _capture(step: Callable[[], None], state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    """Capture `step` as a CUDA graph. The warm-up run that capturing needs takes a step for real, so the state it
    advances (`state`: the slot counts, the rows, the outputs, the policies' windows and masses) is restored after
    it; what it writes to the cache's buffers the replay writes again, the same values at the same slots."""
    saved = [(tensor, tensor.clone()) for tensor in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(stream)
    for tensor, copy in saved:
        tensor.copy_(copy)
    global _GRAPH_POOL
    if _GRAPH_POOL is None:
        _GRAPH_POOL = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_GRAPH_POOL):  # recorded, not run: the first replay takes the step
        step()
    return graph
