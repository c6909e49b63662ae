"""Seconds of work on a device. CUDA runs kernels asynchronously: a host clock read right after a call
measures when the work was queued, not when it was done, so every timing in the package goes through here.

- `now(device)`: the host clock once the device has finished what was queued (one CUDA sync), for coarse
  phases (a rollout, a recompute, an update) where one wait costs nothing;
- `Stopwatch`: the summed length of many short intervals inside a loop (each compression of a rollout),
  as CUDA events recorded in the stream and read once at the end, so timing adds no wait inside the loop.
On a CPU both are plain `time.perf_counter` readings. `HostReads` counts what makes the host wait on a device: the
benchmarks and tests that check the decode step reads nothing back use it.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that read a tensor's value on the host: on a GPU each waits for the device's queue.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
                        "aten.is_nonzero.default", "aten.equal.default", "aten.masked_select.default"})
_INDEXING = frozenset({"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"})


def now(device: torch.device) -> float:
    """`time.perf_counter()` after the work queued on `device` is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Total seconds of the intervals between `start()` and `stop()` calls, read with `seconds()`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total = 0.0
        self.started: float | torch.cuda.Event | None = None
        self.intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        if self.cuda:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.started is None:
            raise RuntimeError("Stopwatch.stop() without a start()")
        if self.cuda:
            stopped = torch.cuda.Event(enable_timing=True)
            stopped.record()
            self.intervals.append((self.started, stopped))
        else:
            self.total += time.perf_counter() - self.started
        self.started = None

    def seconds(self) -> float:
        """The intervals' total so far (on CUDA, once their work is done: one wait for the last event)."""
        if self.intervals:
            self.intervals[-1][1].synchronize()
            self.total += sum(start.elapsed_time(stop) for start, stop in self.intervals) / 1000.0
            self.intervals = []
        return self.total


class HostReads(TorchDispatchMode):
    """Counts the aten operators run under it (`ops`) and those that read a tensor's value on the host (`reads`):
    HOST_READS, and indexing by a boolean mask (its result's size is the mask's count). `Tensor.tolist` dispatches
    no operator on a CPU: not counted."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.reads = 0

    def on_read(self) -> None:
        self.reads += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func)
        if name in HOST_READS or name in _INDEXING and any(
                index is not None and index.dtype in (torch.bool, torch.uint8) for index in args[1]):
            self.on_read()
        return func(*args, **(kwargs or {}))
