"""What a static decode step advances (`step.py`): the batch rows it feeds (`RowState`) and the per-request outputs it
records (`Responses`), each a step participant (`participants.py`) whose every tensor the step advances, and each
placed in the runner's arena when the step is captured (`rollout/arena.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch

from ..arena import StepArena, placed
from .participants import Varying


class _AdvancedState:
    """A step participant (`participants.py`) whose every tensor field the step advances (restored after a capture's
    warm-up), with no buffers, no key and nothing to set up before a step: the rows and the outputs."""

    def step_buffers(self) -> list[torch.Tensor]:
        return []

    def step_state(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def step_key(self) -> tuple:
        return ()

    def begin_step(self, rows: RowState) -> None:
        pass

    def placed_in(self, arena: StepArena | None, role: str, rows: int | None = None):
        """The same fields, each placed in `arena` under `role` and its name (`rollout/arena.py`), with room for
        `rows` rows if given; itself without an arena."""
        if arena is None:
            return self
        return dataclasses.replace(self, **{f.name: placed(arena, f"{role} {f.name}", getattr(self, f.name), rows)
                                            for f in fields(self)})

    def taken_out(self):
        """The same fields, as tensors of their own: what outlives the rollout is not the arena's, which the next
        rollout overwrites."""
        return dataclasses.replace(self, **{f.name: None if getattr(self, f.name) is None else
                                            getattr(self, f.name).clone() for f in fields(self)})


@dataclass
class RowState(_AdvancedState):
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

    # --- a step participant (`participants.py`) ---
    def varying_dims(self) -> Varying:
        return [(t, (0,)) for t in self.step_state()]

    def end_step(self) -> None:
        """The token drawn goes one position and one column further than the one fed."""
        self.positions.add_(1)
        self.columns.add_(1)


@dataclass
class Responses(_AdvancedState):
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

    # --- a step participant (`participants.py`): Q and T change between rollouts (an evaluation's chunks) ---
    def varying_dims(self) -> Varying:
        return [(t, (0, 1) if t.dim() > 1 else (0,)) for t in self.step_state()]

    def end_step(self) -> None:
        pass
