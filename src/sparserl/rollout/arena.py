"""Storage that outlasts a rollout, for the tensors a captured decode step holds, so that its graphs outlast it too.

A CUDA graph replays over the addresses it was captured at (`step.StepRunner`). A rollout's cache buffers, windows,
rows and outputs are new tensors at every event that changes a shape (a row leaving, a buffer growing, a
compression), and new again at the next rollout, so every graph would be captured afresh each rollout. Instead each
such tensor is *placed*: its values are copied to the start of one storage kept per role ("layer 3 keys",
"rows' tokens"), as a contiguous view of the same shape. The same role at the same shape is then the same address
in every rollout of the run, and a graph captured in the first rollout replays in the later ones (vLLM keeps its
decode graphs for the whole run the same way, over buffers allocated once).

A role's storage only grows: the decode loop reserves at a rollout's start what the rollout can reach (its most rows,
its layers' largest capacities), so that storages stop moving after the first rollouts. A growth moves a storage,
and a graph over its old address is never replayed again (its key holds the address), until the runner's bound on
kept graphs drops it. The storages hold their memory between rollouts: `nbytes` reports it.
"""

from __future__ import annotations

import math

import torch


class StepArena:
    """One storage per role, each as large as the largest tensor placed in it so far (see the module)."""

    def __init__(self):
        self._storage: dict[str, torch.Tensor] = {}  # role -> flat uint8
        self.moves = 0  # storages made or grown so far

    def place(self, role: str, tensor: torch.Tensor, rows: int | None = None, slots: int | None = None) -> torch.Tensor:
        """`tensor`'s values at the start of `role`'s storage: a contiguous tensor of its shape and dtype. With `rows`,
        the storage also makes room for the tensor at `rows` rows (dim 0) and, if given, `slots` slots (dim 2): what
        the rollout can reach, made at its start, so that no storage moves mid-run and strands the graphs over it."""
        size = tensor.numel() * tensor.element_size()
        room = size
        if rows is not None:
            shape = list(tensor.shape)
            shape[0] = rows
            if slots is not None:
                shape[2] = slots
            room = max(size, math.prod(shape) * tensor.element_size())
        storage = self._holding(role, room, tensor.device)
        if tensor.untyped_storage().data_ptr() == storage.data_ptr():
            if tensor.data_ptr() == storage.data_ptr() and tensor.is_contiguous():
                return tensor  # already where it goes, laid out as it goes
            tensor = tensor.clone()  # a view of the old layout (a cut of the capacity): read before overwritten
        placed = storage[:size].view(tensor.dtype).view(tensor.shape)
        placed.copy_(tensor)
        return placed

    def _holding(self, role: str, size: int, device: torch.device) -> torch.Tensor:
        """`role`'s storage, made anew (moved) if it holds fewer than `size` bytes."""
        storage = self._storage.get(role)
        if storage is None or storage.numel() < size or storage.device != device:
            storage = self._storage[role] = torch.empty(size, dtype=torch.uint8, device=device)
            self.moves += 1
        return storage

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in one of the storages (a graph over it can be kept)."""
        pointer = tensor.untyped_storage().data_ptr()
        return any(pointer == storage.data_ptr() for storage in self._storage.values())

    def nbytes(self) -> int:
        return sum(storage.numel() for storage in self._storage.values())


def placed(arena: StepArena | None, role: str, tensor: torch.Tensor | None, rows: int | None = None,
           slots: int | None = None) -> torch.Tensor | None:
    """`tensor` placed in `arena` under `role`, with room for `rows` rows and `slots` slots if given
    (`StepArena.place`); as it is without an arena, or when None."""
    return tensor if arena is None or tensor is None else arena.place(role, tensor, rows, slots)
