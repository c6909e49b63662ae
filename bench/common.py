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
