"""A cost model of rollout time: dense, fixed KV budget and budget schedule, from measured rates.

One decode step of a batch of N rows attending over `c` cached tokens per layer costs

    t(c) = overhead + weight FLOPs / flop_rate + weight bytes / bandwidth + cached_token_s · c

- weight FLOPs = 2·N·(P + H·V) and weight bytes = (P + H·V)·width: the non-embedding weights P and
  the LM head, read and multiplied once per step;
- cached_token_s · c: attention over the kept cache, its compute and its K/V reads together, per
  cached token. It is measured, not derived from peak FLOPs, because the masked softmax and the
  elementwise work around it cost as much as the products on a CPU;
- overhead: the rest of the step (Python, kernel launches, norms, RoPE, sampling), plus, with a
  compressed cache, what its bookkeeping adds to every step (window queries, masks).

A compression of one layer (every Δ steps, once the cache holds more than the budget B) costs
`compress_overhead_s + compress_unit_s · units`, with units = N·(B + Δ) for scoring the held
slots plus, for R-KV, N·(Δ·(B + Δ) + B·Δ) for its two similarity products.

The cache length per step follows the engine (`cache_lengths`): dense holds prompt + i tokens at
step i; a budget is first passed by one token, cut to B, then regrows to B + Δ between cuts; a
schedule reads B from the cached length. `probe` measures the rates on this machine for a model
in seconds (a matmul, a streaming read, two short dense and two short sparse rollouts); `Rates`
saves and loads them as JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .rollout.schedule import BudgetSchedule


@dataclass(frozen=True)
class Rates:
    flop_rate: float  # FLOP/s of a float32 matmul the size of a decode step's (the weights' work)
    bandwidth: float  # bytes/s of a streaming read (the weights' traffic)
    cached_token_s: float  # per decode step and cached token, all layers: attention's compute and KV reads
    overhead_s: float  # the rest of a decode step of this model (Python, launches, norms, sampling)
    sparse_overhead_s: float  # what a compressed cache adds to every decode step (window queries, masks)
    compress_overhead_s: float  # per compression and layer: the fixed part
    compress_unit_s: float  # per compression and layer: per unit of `Shapes.compress_units`

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> Rates:
        return cls(**json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    body_params: int  # parameters outside the embedding and the LM head
    width: int  # bytes per weight and cache element

    @classmethod
    def of(cls, model) -> Shapes:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
        body = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                   head_dim, config.vocab_size, body, next(model.parameters()).element_size())

    def weight_flops(self, rows: int) -> float:
        return 2 * rows * (self.body_params + self.hidden * self.vocab)

    def weight_bytes(self) -> float:
        return (self.body_params + self.hidden * self.vocab) * self.width

    @staticmethod
    def compress_units(rows: int, budget: int, interval: int, policy: str) -> float:
        """Work of one compression of one layer, in elements: scoring every held slot, plus R-KV's
        similarity of the Δ appended slots against all held and of the kept against the evicted."""
        held = budget + interval
        return rows * (held + (interval * held + budget * interval if policy == "rkv" else 0))


def cache_lengths(prompt: int, new_tokens: int, schedule: BudgetSchedule | None, interval: int) -> tuple[list[int], list[int]]:
    """(tokens each decode forward attends over, per layer; the budgets of the compressions), as the
    engine runs: after the prefill, each of the new_tokens − 1 decode forwards adds one token; at
    least Δ forwards after the last compression, a cache above the budget is cut back to it."""
    lengths, compressions = [], []
    held, since = prompt, 0
    for step in range(new_tokens - 1):
        if schedule is not None and since >= interval:
            budget = schedule.budget(prompt + step)
            if held > budget:
                compressions.append(budget)
                held, since = budget, 0
        held += 1
        since += 1
        lengths.append(held)
    return lengths, compressions


class CostModel:
    def __init__(self, rates: Rates, shapes: Shapes):
        self.rates, self.shapes = rates, shapes

    def step_seconds(self, rows: int, cached: float, sparse: bool = False) -> float:
        r, s = self.rates, self.shapes
        return (r.overhead_s + s.weight_flops(rows) / r.flop_rate + s.weight_bytes() / r.bandwidth
                + r.cached_token_s * cached + (r.sparse_overhead_s if sparse else 0.0))

    def compression_seconds(self, rows: int, budget: int, interval: int, policy: str) -> float:
        r = self.rates
        return self.shapes.layers * (r.compress_overhead_s
                                     + r.compress_unit_s * Shapes.compress_units(rows, budget, interval, policy))

    def rollout_seconds(self, rows: int, prompt: int, new_tokens: int, schedule: BudgetSchedule | None = None,
                        interval: int = 8, policy: str = "rkv") -> dict[str, float]:
        """Predicted decode and compression seconds of one rollout (dense when `schedule` is None)."""
        lengths, compressions = cache_lengths(prompt, new_tokens, schedule, interval)
        decode = sum(self.step_seconds(rows, c, schedule is not None) for c in lengths)
        compress = sum(self.compression_seconds(rows, b, interval, policy) for b in compressions)
        return {"decode_s": decode, "compress_s": compress, "total_s": decode + compress,
                "compressions": len(compressions), "mean_cached": sum(lengths) / max(len(lengths), 1)}

    def speedup(self, rows: int, prompt: int, new_tokens: int, schedule: BudgetSchedule, **kwargs) -> float:
        dense = self.rollout_seconds(rows, prompt, new_tokens, None)["total_s"]
        return dense / self.rollout_seconds(rows, prompt, new_tokens, schedule, **kwargs)["total_s"]


# ---------------------------------------------------------------------------------- the probe
def _timed(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two points, both clipped at 0."""
    slope = max((y2 - y1) / (x2 - x1), 0.0)
    return max(y1 - slope * x1, 0.0), slope


def probe(model, rows: int, policy: str = "rkv") -> Rates:
    """Measure this machine's rates for `model` at batch `rows` (seconds, not minutes).

    The weights' terms come from a matmul and a streaming read; the per-cached-token and per-step
    terms from two short dense rollouts at different cache lengths; the compression terms from two
    short sparse rollouts at different budgets."""
    from .rollout.engine import KVCompression, RolloutEngine, SamplingConfig

    shapes = Shapes.of(model)
    dtype = next(model.parameters()).dtype
    a = torch.randn(rows, shapes.hidden, dtype=dtype)
    b = torch.randn(shapes.hidden, 4 * shapes.hidden, dtype=dtype)
    flop_rate = 2 * rows * shapes.hidden * 4 * shapes.hidden / _timed(lambda: a @ b, 200)
    big = torch.ones(64 * 2**20 // 4)
    bandwidth = big.numel() * 4 / _timed(lambda: big.sum(), 20)
    new = 48

    def rollout(prompt: int, compression, tokens: int = new):
        prompts = [[(i * 7 + r) % shapes.vocab for i in range(prompt)] for r in range(rows)]
        engine = RolloutEngine(model, compression, record_evictions=False)
        batch = engine.generate(prompts, SamplingConfig(max_new_tokens=tokens, temperature=1.0, eos_token_id=None,
                                                        pad_token_id=0), torch.Generator().manual_seed(0))
        return batch

    def decode_step_seconds(prompt: int, compression=None) -> float:
        """The prefill, timed alone, taken out; the faster of two tries (a busy machine only adds time)."""
        return min((rollout(prompt, compression).rollout_seconds - rollout(prompt, compression, 1).rollout_seconds)
                   / (new - 1) for _ in range(2))

    rollout(8, None)  # warm-up
    short, long = 64, 64 + 768
    t_short, t_long = decode_step_seconds(short), decode_step_seconds(long)
    never_full = KVCompression(policy, budget=short + new + 8, window=8, interval=8)
    sparse_overhead = max(decode_step_seconds(short, never_full) - t_short, 0.0)
    step_fixed, cached_token = _line(short + new / 2, t_short, long + new / 2, t_long)
    weights = shapes.weight_flops(rows) / flop_rate + shapes.weight_bytes() / bandwidth
    points = []
    for budget, interval in ((16, 8), (256, 32)):
        # Steady-state compressions only: R-KV's first one scores the whole cache from scratch.
        compression = KVCompression(policy, budget=budget, window=min(8, budget - 1), interval=interval)
        first = rollout(budget, compression, interval + 2).kv
        more = rollout(budget, compression, 6 * interval + 2).kv
        per = (more.compress_seconds - first.compress_seconds) / max(more.compressions - first.compressions, 1)
        points.append((Shapes.compress_units(rows, budget, interval, policy), per / shapes.layers))
    compress_fixed, compress_unit = _line(*points[0], *points[1])
    return Rates(flop_rate, bandwidth, cached_token, max(step_fixed - weights, 0.0), sparse_overhead,
                 compress_fixed, compress_unit)
