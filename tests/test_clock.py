"""Timings of device work (`sparserl.model.clock`): the stopwatch sums its intervals and only those."""

from __future__ import annotations

import time

import pytest
import torch

from sparserl.model import clock
from sparserl.model.clock import Stopwatch, now


def test_the_stopwatch_sums_its_intervals_and_not_the_gaps_between_them(monkeypatch):
    """On a clock we move by hand (a real sleep's length depends on the machine's load): three intervals of 2 s with
    gaps of 5 s between them, then one started and never stopped (a compression that found nothing to cut)."""
    readings = iter([0.0, 2.0, 7.0, 9.0, 14.0, 16.0, 21.0])
    monkeypatch.setattr(clock.time, "perf_counter", lambda: next(readings))
    watch = Stopwatch(torch.device("cpu"))
    for _ in range(3):
        watch.start()
        watch.stop()
    assert watch.seconds() == 6.0
    watch.start()
    assert watch.seconds() == 6.0


def test_stop_without_start_is_a_bug_said_as_such():
    with pytest.raises(RuntimeError, match="without a start"):
        Stopwatch(torch.device("cpu")).stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timings_wait_for_the_work():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    started = now(device)
    for _ in range(20):
        a = a @ a / 64
    queued = time.perf_counter() - started
    done = now(device) - started
    assert done >= queued
    watch = Stopwatch(device)
    watch.start()
    for _ in range(20):
        a = a @ a / 64
    watch.stop()
    assert watch.seconds() > 0
