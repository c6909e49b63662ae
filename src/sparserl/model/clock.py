"""Seconds of work on a device. CUDA runs kernels asynchronously: a host clock read right after a call
measures when the work was queued, not when it was done, so every timing in the package goes through here.

- `now(device)`: the host clock once the device has finished what was queued (one CUDA sync), for coarse
  phases (a rollout, a recompute, an update) where one wait costs nothing;
- `Stopwatch`: the summed length of many short intervals inside a loop (each compression of a rollout),
  as CUDA events recorded in the stream and read once at the end, so timing adds no wait inside the loop.
On a CPU both are plain `time.perf_counter` readings.
"""

from __future__ import annotations

import time

import torch


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
