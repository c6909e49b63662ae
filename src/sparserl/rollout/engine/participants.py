"""The one contract of the static step: what each participant in a step exposes to the runner that compiles and
captures it (`step.StepRunner`).

A participant is an object whose device tensors a static step reads or writes: the cache (`cache.BufferCache`), the
mask provider with the KV policies' windows and masses (`rollout_attention.RolloutAttention`), the rows
(`step_state.RowState`) and the outputs (`step_state.Responses`). For each the runner needs to know:

- `step_buffers`: the tensors the step writes the same values to if it runs twice (the cache's slots): a capture
  holds their addresses, and its warm-up's writes are rewritten by the first replay;
- `step_state`: the tensors the step advances (counters, windows, outputs): a capture holds their addresses too, and
  restores them after its warm-up, which takes a real step;
- `step_key`: the Python values the step's work depends on beside its tensors (a new value is a new graph);
- `varying_dims`: which dims of its tensors may change within a run (the rows in flight, the cache's capacity), so
  that one compilation serves every size (`mark_varying`) instead of one per shape;
- `begin_step(rows)` and `end_step()`: what it sets up before the step's forward and settles after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

Varying = list[tuple[torch.Tensor, tuple[int, ...]]]


class FedRows(Protocol):
    """What a participant reads of the rows a step feeds (`step_state.RowState`: naming it here would import
    step_state.py, which imports this module): each row's column in the left-padded layout and whether the
    token it feeds is real, `[N]` each."""

    columns: torch.Tensor
    fed_real: torch.Tensor


class StepParticipant(Protocol):
    def step_buffers(self) -> list[torch.Tensor]:
        """Tensors the step rewrites with the same values if run twice (not restored after a capture's warm-up)."""
        ...

    def step_state(self) -> list[torch.Tensor]:
        """Tensors the step advances (restored after a capture's warm-up)."""
        ...

    def step_key(self) -> tuple:
        """Python values that shape the step besides its tensors."""
        ...

    def varying_dims(self) -> Varying:
        """Each tensor of this participant with the dims of it that may change size within a run."""
        ...

    def begin_step(self, rows: FedRows) -> None:
        """Before the step's forward, which feeds one token per row of `rows`."""
        ...

    def end_step(self) -> None:
        """After the step's forward."""
        ...


def step_buffers(participants: Iterable[StepParticipant]) -> list[torch.Tensor]:
    return [t for p in participants for t in p.step_buffers()]


def step_state(participants: Iterable[StepParticipant]) -> list[torch.Tensor]:
    return [t for p in participants for t in p.step_state()]


def step_key(participants: Iterable[StepParticipant]) -> tuple:
    return tuple(value for p in participants for value in p.step_key())


def varying_dims(participants: Iterable[StepParticipant]) -> Varying:
    return [entry for p in participants for entry in p.varying_dims()]


def mark_varying(varying: Varying) -> None:
    """Tell torch.compile that these dims change within a run, so that it compiles one graph over symbolic sizes
    rather than one per size (`maybe_`: a dim the step needs fixed, a size of 1 among them, is specialised instead
    of refused)."""
    for tensor, dims in varying:
        if tensor is not None and tensor.dim():
            torch._dynamo.maybe_mark_dynamic(tensor, [d for d in dims if d < tensor.dim()])
