"""Helpers shared by the benchmarks (run them as `python bench/NAME.py`, which puts bench/ on the path)."""

from __future__ import annotations

import json
import re
import statistics
import time
import traceback
from pathlib import Path

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


def qwen_shape(small: bool):
    """The Qwen2.5-1.5B shape the GPU benches decode (28 layers, 12 query / 2 KV heads of 128, vocabulary 151,936,
    tied embeddings), or with `small` a 2-layer stand-in for their CPU dry runs."""
    from transformers import Qwen2Config

    if small:
        return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           tie_word_embeddings=True)
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                       tie_word_embeddings=True)


class Recorder:
    """A GPU bench's records: each one a JSON line appended to `out` (and printed), stamped with the seconds since
    the start; the device synchronised around timings; and cells run guarded, so that a failing cell is recorded as
    a result (and the next cells still run), a cell past `deadline` seconds is recorded as skipped, and a cell whose
    name `only` (a regular expression, "" for all) does not match is not run."""

    def __init__(self, out: str, device: torch.device, deadline: float, only: str = ""):
        self.device = device
        self.cuda = device.type == "cuda"
        self.deadline, self.only = deadline, only
        self.started = time.time()
        self.out = Path(out).open("a")
        self.records: list[dict] = []

    def emit(self, record: dict) -> None:
        record["t"] = round(time.time() - self.started, 1)
        self.records.append(record)
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        print(json.dumps(record), flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def late(self) -> bool:
        return time.time() - self.started > self.deadline

    def peak_gib(self) -> float | None:
        """The device's peak allocated GiB since `reset_peak` (None off CUDA)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def guarded(self, what: str, run) -> None:
        """Emit each record of `run()` (an iterable of records, a generator emitting as it goes); an exception is
        emitted as an "error" record of cell `what`. The device's cached memory is freed afterwards."""
        if self.only and not re.search(self.only, what):
            return
        if self.late():
            self.emit({"what": "skipped", "which": what})
            return
        try:
            for record in run():
                self.emit(record)
        except Exception as error:  # noqa: BLE001 - a failed cell is a result; the next cells still run
            self.emit({"what": "error", "which": what, "error": repr(error)[:500],
                       "trace": traceback.format_exc()[-1500:]})
        if self.cuda:
            torch.cuda.empty_cache()
