"""One static decode step: the rows' tokens in, the next tokens and their log-probs out, over fixed-shape buffers.

The decode loop (`decode_loop.py`) decides; the step computes. Between two compressions every decode step of a
rollout is this one function of device tensors updated in place: the token each row feeds, its position, column,
cache slot and realness, its draw counter (`RowState`), the cache buffers (`BufferLayer.static_slots`), the policies'
window of queries and attention mass, and the per-request outputs (`Responses`). Its masks come from the cache's
realness and columns inside the step; nothing in it reads a value back to the host, indexes by a boolean mask or
branches on a tensor's value, and no shape changes from one step to the next. So it can be captured as one CUDA graph
per (rows, cache capacity) and replayed (`StepRunner`, as vLLM does), compiled whole
(`torch.compile(fullgraph=True, dynamic=False)`), or both, the compiled step captured: the loop only calls it
between the events that change a shape (rows joining or leaving, a buffer growing, a compression).

Each row draws the token at its own response index from its own seed (`token_draws.row_uniforms`), so a row's tokens
do not depend on the rows beside it, and the step's outputs are the eager step's whether it runs eagerly, compiled
or replayed (tests/test_static_step.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from ...errors import ConfigError
from ...model.structure import rope_depends_on_length, text_config
from .token_draws import draw_tokens, row_uniforms

COMPILE_CHOICES = ("auto", "true", "false")
MODES = ("eager", "compile", "graphs", "compiled-graphs")


@dataclass
class RowState:
    """The batch rows, as the static step reads them and leaves them for the next step, `[N]` each.

    tokens: the token each row feeds next (the last one drawn); fed_real: whether it is a real token (its row was
    live when it was drawn); positions, columns: its RoPE position and its column in the left-padded layout (its
    cache slot is the layer's count of the row's slots, `BufferLayer.slot_counts`); counters: the response index it
    was drawn at; requests: the request each row samples; seeds: each row's sampling seed (None: the rows share a
    generator)."""

    tokens: torch.Tensor
    fed_real: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor
    counters: torch.Tensor
    requests: torch.Tensor
    seeds: torch.Tensor | None

    def select(self, index: torch.Tensor) -> RowState:
        """The rows `index`, in that order (new tensors: a captured step is captured again)."""
        return RowState(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                           for f in fields(self)})

    def extended(self, other: RowState) -> RowState:
        """These rows, then `other`'s."""
        return RowState(**{f.name: None if getattr(self, f.name) is None else
                           torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self)})


@dataclass
class Responses:
    """What a rollout records per request (Q requests, T = max_new_tokens): the tokens `[Q, T]`, their log-probs
    `[Q, T]`, the response lengths `[Q]`, whether a request ended at EOS `[Q]`, whether it is still sampling `[Q]`,
    the real tokens fed to its cache, prompt included `[Q]`, and, when kept, each step's whole processed
    distribution `[Q, T, V]`."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    live: torch.Tensor
    fed: torch.Tensor
    distributions: torch.Tensor | None = None


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
    still = fed_real & (own < sampling.max_new_tokens - 1)
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
    cache.begin_static(rows.columns[:, None], rows.fed_real[:, None])
    provider.begin_static_step(rows.fed_real)
    logits = model(input_ids=rows.tokens[:, None], position_ids=rows.positions[:, None],
                   **{cache_keyword: cache}, use_cache=True).logits[:, -1]
    cache.end_static()
    provider.end_static_step()
    out.fed.index_put_((rows.requests,), out.fed[rows.requests] + rows.fed_real.long())
    draw_and_record(logits, rows, out, sampling, rows.counters + 1, generator)
    rows.positions.add_(1)
    rows.columns.add_(1)


class StepRunner:
    """Runs a static step (`decode_step`, the speculative sampler's draft and verification steps): eagerly, compiled
    (`torch.compile(fullgraph=True, dynamic=False)`, the CPU's proof that the step has no graph break) or replayed
    from CUDA graphs, each captured on the first call that meets its key (the step, the Python values that shape it,
    the addresses and shapes of every tensor it reads and writes) and dropped once the buffers it holds are replaced.

    `mode`: "eager", "compile", "graphs" or "compiled-graphs" (compiled, then the compiled step captured, so that
    one replay launches the compiler's fused kernels); `compile_decode` (auto | true | false) chooses: auto is graphs
    on CUDA, eager elsewhere; true is compiled-graphs on CUDA and compile elsewhere."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"step mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self._compiled: dict[Callable, Callable] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

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

    def release(self) -> None:
        """Drop the captured graphs (they hold the rollout's buffers and their memory pools)."""
        self._graphs.clear()

    def run(self, step: Callable, args: tuple, buffers: list[torch.Tensor], state: list[torch.Tensor],
            key: tuple = ()) -> None:
        """`step(*args)`, which reads and writes `buffers` (writing the same values if run twice, as a cache's slots)
        and advances `state` (counters, windows, outputs: restored after the warm-up a capture needs). `key`: the
        Python values the step's work depends on."""
        if self.mode == "eager":
            step(*args)
        elif self.mode == "compile":
            self._run_compiled(step, args)
        else:
            self._replay(step, args, buffers, state, key)

    def _compiled_step(self, step: Callable) -> Callable:
        if step not in self._compiled:
            self._compiled[step] = torch.compile(step, fullgraph=True, dynamic=False)
        return self._compiled[step]

    def _run_compiled(self, step: Callable, args: tuple) -> None:
        try:
            self._compiled_step(step)(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self._past_recompile_limit("eager", stacklevel=4)
            step(*args)

    def _replay(self, step, args, buffers, state, key) -> None:
        held = tuple((t.data_ptr(), tuple(t.shape)) for t in (*buffers, *state) if t is not None)
        full_key = (step, key, held)
        graph = self._graphs.get(full_key)
        if graph is None:
            # A graph of this step over other buffers reads tensors that no longer hold the rollout: drop it (one of
            # this step over these buffers with another key, a speculative round's γ, stays).
            for stale in [k for k in self._graphs if k[0] is step and k[2] != held]:
                del self._graphs[stale]
            graph = self._graphs[full_key] = self._capture_step(step, args, [t for t in state if t is not None])
        graph.replay()

    def _capture_step(self, step: Callable, args: tuple, state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        if self.mode == "compiled-graphs":
            compiled = self._compiled_step(step)
            try:
                return _capture(lambda: compiled(*args), state)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                self._past_recompile_limit("graphs", stacklevel=5)
        return _capture(lambda: step(*args), state)

    def _past_recompile_limit(self, fallback_mode: str, stacklevel: int) -> None:
        # Each (rows, capacity) is a compilation; rows leaving and joining can make more than dynamo keeps. Dynamo
        # raises before the step runs (in a capture's warm-up, before it), so no state has moved and the rest of the
        # rollout goes on uncompiled: the same step, float rounding aside. `stacklevel` names `run`'s caller.
        how = "run eagerly" if fallback_mode == "eager" else "are captured uncompiled"
        warnings.warn(f"compile_decode: more step shapes than torch.compile keeps compiled; the rest of this "
                      f"rollout's steps {how}", RuntimeWarning, stacklevel=stacklevel)
        self.mode = fallback_mode


def run_decode_step(runner: StepRunner, model, cache, provider, rows: RowState, out: Responses, sampling,
                    cache_keyword: str, generator: torch.Generator | None = None) -> None:
    """`decode_step` through `runner`, with the tensors it reads and advances."""
    state = [*cache.static_counters(), *provider.static_tensors(), *(getattr(rows, f.name) for f in fields(rows)),
             *(getattr(out, f.name) for f in fields(out))]
    if rows.seeds is None:  # rows drawing from one generator: eagerly, outside any graph
        decode_step(model, cache, provider, rows, out, sampling, cache_keyword, generator)
        return
    runner.run(decode_step, (model, cache, provider, rows, out, sampling, cache_keyword), cache.static_tensors(),
               state, provider.static_key())


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
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: the first replay takes the step
        step()
    return graph
