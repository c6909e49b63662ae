"""Helpers shared by the benchmarks (run them as `python bench/NAME.py`, which puts bench/ on the path)."""

from __future__ import annotations

import statistics
import time

import torch


def contention_probe(threads: int, repeats: int = 200) -> float:
    """Median ms of one tiny linear at `threads` threads: it balloons when the cores are shared."""
    torch.set_num_threads(threads)
    x, w = torch.randn(64, 128), torch.randn(384, 128)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compression_interval(length: int) -> int:
    """Δ of the benches' B = L/4 rows: max(8, L/32), so 16/32/64/128 at L = 512/1024/2048/4096."""
    return max(8, length // 32)
