"""A cost model of rollout time: dense, fixed KV budget and budget schedule, from measured rates.

One decode step of a batch of N rows attending over `c` cached tokens per layer costs

    t(c) = overhead + weight FLOPs / flop_rate + weight bytes / bandwidth + cached_token_s · c
           (+ sparse_overhead_s with a compressed cache)

- weight FLOPs = 2·N·(P + H·V) and weight bytes = (P + H·V)·width: the non-embedding weights P and
  the LM head, read and multiplied once per step;
- cached_token_s · c: attention over the kept cache, its compute and its K/V reads together, per
  cached token. It is measured, not derived from peak FLOPs, because the masked softmax and the
  elementwise work around it cost as much as the products on a CPU;
- overhead: the rest of the step (Python, kernel launches, norms, RoPE, sampling). On a CPU with a
  small model it is most of a step, and a compressed cache does not shrink it; sparse_overhead_s is
  what the compressed cache's bookkeeping (window queries, masks) adds to every step.

A compression of one layer holding `h` slots cut to B, `a` of them appended since the last cut,
costs `compress_overhead_s + compress_unit_s · units`, units = N·(h + a·h + h·(h − B)) for R-KV
(scoring the held slots; the appended rows of the similarity; the held slots against the evicted)
and N·h for the other policies. In steady state h = B + Δ and a = h − B = Δ, so R-KV's similarity
work is O(B·Δ) per compression; a rollout's first one has a = h (the whole matrix).

A rollout is the sum of its steps and compressions over the engine's cache-length trajectory
(`cache_lengths`): dense holds prompt + i tokens at step i; a budget is passed, then the cache is
cut to B every Δ steps, so it runs B+1..B+Δ between cuts; a schedule reads B from the cached length.
The predicted speedup with free compression (compression time 0) is the most a budget can give
on this machine: dense time / sparse decode time.

The scheduler's rollouts (`predict_scheduled`): at most S of a step's requests decode at once (S from
the KV memory a row reserves, `Shapes.row_bytes`), a waiting request joining as a row ends; a step
holds only the rows still decoding, so the weights' FLOPs and attention scale with them.

`CostModel.probe` measures the rates for a model and batch in seconds (a matmul, a streaming read,
short dense rollouts at two cache lengths, a never-full sparse rollout, steady-state compressions
at two budgets) and caches them in a JSON file (default ~/.cache/sparserl/cost_rates.json), keyed
by the model's shapes, the batch, the policy and the torch thread count, so later predictions reuse
them; `CostModel.load` reads them back without probing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...model.clock import now
from ...model.structure import text_config
from ..sparsity.budgets import BudgetSchedule
from ..sparsity.eviction import KVCompression

DEFAULT_CACHE = Path.home() / ".cache" / "sparserl" / "cost_rates.json"


@dataclass(frozen=True)
class Rates:
    flop_rate: float  # FLOP/s of a float32 matmul the size of a decode step's (the weights' work)
    bandwidth: float  # bytes/s of a streaming read (the weights' traffic)
    cached_token_s: float  # per decode step and cached token, all layers: attention's compute and KV reads
    overhead_s: float  # the rest of a decode step of this model (Python, launches, norms, sampling)
    sparse_overhead_s: float  # what a compressed cache adds to every decode step (window queries, masks)
    compress_overhead_s: float  # per compression and layer: the fixed part
    compress_unit_s: float  # per compression and layer: per unit of `Shapes.compress_units`


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
        config = text_config(model)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
        body = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                   head_dim, config.vocab_size, body, next(model.parameters()).element_size())

    def weight_flops(self, rows: int) -> float:
        return 2 * rows * (self.body_params + self.hidden * self.vocab)

    def weight_bytes(self) -> float:
        return (self.body_params + self.hidden * self.vocab) * self.width

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (no sliding-window layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.width

    def row_bytes(self, prompt: int, new_tokens: int, compression: KVCompression | None = None) -> int:
        """What one row's cache can reach, as the engine reserves it (`RolloutEngine.row_bytes`): the whole
        sequence when dense, max(prompt, the largest budget) + one interval when compressed."""
        slots = prompt + new_tokens
        if compression is not None:
            slots = min(max(prompt, compression.budgets.max_budget) + compression.interval, slots)
        return slots * self.kv_bytes_per_token()

    @staticmethod
    def compress_units(rows: int, held: int, budget: int, appended: int, policy: str) -> float:
        """Work of one compression of one layer, in elements (see the module docstring)."""
        return rows * (held + (appended * held + held * (held - budget) if policy == "rkv" else 0))


def cache_lengths(prompt: int, new_tokens: int, schedule: BudgetSchedule | None,
                  interval: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(tokens each decode forward attends over, per layer; (held, budget, appended) of each
    compression), as the engine runs: after the prefill, each of the new_tokens − 1 decode forwards
    adds one token; at least Δ forwards after the last compression, a cache above the budget is cut."""
    lengths, compressions = [], []
    held, since, scored = prompt, 0, 0  # scored: slots the policy has seen (0 before the first cut)
    for step in range(new_tokens - 1):
        if schedule is not None and since >= interval:
            budget = schedule.budget(prompt + step)
            if held > budget:
                compressions.append((held, budget, held - scored))
                held, since, scored = budget, 0, budget
        held += 1
        since += 1
        lengths.append(held)
    return lengths, compressions


class CostModel:
    def __init__(self, rates: Rates, shapes: Shapes, probe_rows: int | None = None):
        """`probe_rows`: the batch the rates were measured at; with it, attention's cost scales with
        the rows a step holds (`predict_scheduled`); without, every step is taken to hold that batch."""
        self.rates, self.shapes, self.probe_rows = rates, shapes, probe_rows

    @classmethod
    def probe(cls, model, rows: int, policy: str = "rkv", long_cache: int = 1024,
              cache: Path | None = DEFAULT_CACHE, reprobe: bool = False) -> CostModel:
        """The model's cost model: rates from `cache` (a JSON file) when it has them for this model,
        batch, policy and thread count, else probed (`probe`) and saved there; `cache=None` never saves."""
        shapes = Shapes.of(model)
        key = _cache_key(shapes, rows, policy, long_cache)
        stored = json.loads(Path(cache).read_text()) if cache is not None and Path(cache).exists() else {}
        if key in stored and not reprobe:
            return cls(Rates(**stored[key]), shapes, rows)
        rates = probe(model, rows, policy, long_cache)
        if cache is not None:
            stored[key] = asdict(rates)
            Path(cache).parent.mkdir(parents=True, exist_ok=True)
            Path(cache).write_text(json.dumps(stored, indent=2))
        return cls(rates, shapes, rows)

    @classmethod
    def load(cls, model, rows: int, policy: str = "rkv", long_cache: int = 1024,
             cache: Path = DEFAULT_CACHE) -> CostModel:
        """The cached rates only; KeyError when this model and batch were never probed."""
        shapes = Shapes.of(model)
        return cls(Rates(**json.loads(Path(cache).read_text())[_cache_key(shapes, rows, policy, long_cache)]), shapes,
                   rows)

    def step_seconds(self, rows: int, cached: float, sparse: bool = False) -> float:
        r, s = self.rates, self.shapes
        rows_share = rows / self.probe_rows if self.probe_rows else 1.0
        return (r.overhead_s + s.weight_flops(rows) / r.flop_rate + s.weight_bytes() / r.bandwidth
                + r.cached_token_s * cached * rows_share + (r.sparse_overhead_s if sparse else 0.0))

    def compression_seconds(self, rows: int, held: int, budget: int, appended: int, policy: str) -> float:
        r = self.rates
        return self.shapes.layers * (r.compress_overhead_s + r.compress_unit_s
                                     * Shapes.compress_units(rows, held, budget, appended, policy))

    def predict_rollout_seconds(self, rows: int, prompt: int, new_tokens: int,
                                compression: KVCompression | None = None) -> dict[str, float]:
        """Predicted decode and compression seconds of one rollout of `rows` rows, each a prompt
        of `prompt` tokens and `new_tokens` sampled ones (dense when `compression` is None)."""
        schedule = compression.budgets if compression else None
        interval = compression.interval if compression else 1
        lengths, compressions = cache_lengths(prompt, new_tokens, schedule, interval)
        decode = sum(self.step_seconds(rows, c, compression is not None) for c in lengths)
        compress = sum(self.compression_seconds(rows, *c, compression.policy) for c in compressions)
        return {"decode_s": decode, "compress_s": compress, "total_s": decode + compress,
                "compressions": len(compressions), "mean_cached": sum(lengths) / max(len(lengths), 1)}

    def predict_scheduled(self, response_lengths: list[int], prompt: int, rows_in_flight: int,
                          compression: KVCompression | None = None) -> dict[str, float]:
        """Predicted seconds of a step's requests (their response lengths, in queue order) run as the
        engine's `DecodeLoop` runs them: at most `rows_in_flight` rows at once, a row leaving the batch
        when it has drawn its last token and a waiting request joining in its place (it feeds its first
        token the step after). A forward attends over the longest cached row (the buffers' width); each
        cohort (the rows that joined together) is compressed on its own clock. Prefills are left out,
        and rows are taken to leave at once (the engine waits for an eighth of the batch). Needs
        `probe_rows`."""
        if not self.probe_rows:
            raise ValueError("predict_scheduled needs the batch the rates were probed at (probe_rows)")
        schedule = compression.budgets if compression else None
        interval = compression.interval if compression else 1
        lengths, compressions = cache_lengths(prompt, max(response_lengths), schedule, interval)
        cuts = dict(zip((i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1]), compressions))
        active = [(length, 0) for length in response_lengths[:rows_in_flight]]  # (length, its first draw's step)
        queue = list(response_lengths[rows_in_flight:])
        decode = compress = 0.0
        step, cohorts = 0, 1
        while queue or active:
            # A row feeds token i at its own step i while it has more to draw: its response is longer than i + 1.
            active = [(length, start) for length, start in active if step - start < length - 1]
            if active:
                decode += self.step_seconds(len(active), max(lengths[step - start] for _, start in active),
                                            compression is not None)
                for start in {start for _, start in active}:
                    if step - start in cuts:
                        rows = sum(1 for _, s in active if s == start)
                        compress += self.compression_seconds(rows, *cuts[step - start], compression.policy)
            joining = min(len(queue), rows_in_flight - len(active))
            if joining:
                active += [(length, step + 1) for length in queue[:joining]]
                queue, cohorts = queue[joining:], cohorts + 1
            step += 1
        return {"decode_s": decode, "compress_s": compress, "total_s": decode + compress,
                "rows_in_flight": rows_in_flight, "cohorts": cohorts}

    def predicted_speedup(self, rows: int, prompt: int, new_tokens: int, compression: KVCompression,
                          free_compression: bool = False) -> float:
        """Dense time over sparse time; with `free_compression`, over the sparse decode time alone
        (what a zero-cost compression would give)."""
        dense = self.predict_rollout_seconds(rows, prompt, new_tokens)["total_s"]
        sparse = self.predict_rollout_seconds(rows, prompt, new_tokens, compression)
        return dense / sparse["decode_s" if free_compression else "total_s"]


def _cache_key(shapes: Shapes, rows: int, policy: str, long_cache: int) -> str:
    return (f"{shapes.layers}x{shapes.hidden} q{shapes.q_heads} kv{shapes.kv_heads} d{shapes.head_dim} "
            f"v{shapes.vocab} p{shapes.body_params} w{shapes.width} | rows {rows} | {policy} | "
            f"cache {long_cache} | threads {torch.get_num_threads()} | torch {torch.__version__}")


# ---------------------------------------------------------------------------------- the probe
def _timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    started = now(device)
    for _ in range(repeats):
        fn()
    return (now(device) - started) / repeats


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two points, both clipped at 0."""
    slope = max((y2 - y1) / (x2 - x1), 0.0)
    return max(y1 - slope * x1, 0.0), slope


def probe(model, rows: int, policy: str = "rkv", long_cache: int = 1024) -> Rates:
    """Measure this machine's rates for `model` at batch `rows` (seconds, not minutes).

    The weights' terms come from a matmul and a streaming read; the per-cached-token and per-step
    terms from two short dense rollouts at cache lengths 64 and `long_cache` (choose it near the
    mean cache of the rollouts to predict); the compression terms from steady-state compressions of
    two short sparse rollouts, at budget 64 and at `long_cache` / 2."""
    from ..batch import SamplingConfig
    from .engine import RolloutEngine

    shapes = Shapes.of(model)
    parameter = next(model.parameters())
    dtype, device = parameter.dtype, parameter.device
    a = torch.randn(rows, shapes.hidden, dtype=dtype, device=device)
    b = torch.randn(shapes.hidden, 4 * shapes.hidden, dtype=dtype, device=device)
    flop_rate = 2 * rows * shapes.hidden * 4 * shapes.hidden / _timed(lambda: a @ b, 200, device)
    big = torch.ones(64 * 2**20 // 4, device=device)
    bandwidth = big.numel() * 4 / _timed(lambda: big.sum(), 20, device)
    new = 48

    def rollout(prompt: int, compression, tokens: int = new, on_step=None):
        prompts = [[(i * 7 + r) % shapes.vocab for i in range(prompt)] for r in range(rows)]
        engine = RolloutEngine(model, compression, record_evictions=False)
        batch = engine.generate(prompts, SamplingConfig(max_new_tokens=tokens, temperature=1.0, eos_token_id=None,
                                                        pad_token_id=0), torch.Generator(device).manual_seed(0), on_step)
        return batch

    def decode_step_seconds(prompt: int, compression=None) -> float:
        """The median time between decode steps: no prefill in it, and robust to a busy machine's spikes
        (subtracting a timed prefill instead was off by half at long caches)."""
        stamps: list[float] = []
        rollout(prompt, compression, on_step=lambda _: stamps.append(now(device)))
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        return gaps[len(gaps) // 2]

    rollout(8, None)  # warm-up
    short, long = 64, max(long_cache, 128)
    t_short, t_long = decode_step_seconds(short), decode_step_seconds(long)
    never_full = KVCompression(policy, budget=short + new + 8, window=8, interval=8)
    sparse_overhead = max(decode_step_seconds(short, never_full) - t_short, 0.0)
    # A step's cache holds prompt + 1 .. prompt + new - 1 tokens; the median step sits mid-way.
    step_fixed, cached_token = _line(short + new / 2, t_short, long + new / 2, t_long)
    weights = shapes.weight_flops(rows) / flop_rate + shapes.weight_bytes() / bandwidth
    points = []
    # The per-unit cost falls with size, so the second point sits near the largest budgets predicted.
    for budget, interval in ((64, 16), (max(long_cache // 2, 128), max(long_cache // 16, 16))):
        # Steady-state compressions only: R-KV's first one scores the whole cache from scratch.
        compression = KVCompression(policy, budget=budget, window=min(8, budget - 1), interval=interval)
        first = rollout(budget, compression, interval + 2).kv
        more = rollout(budget, compression, 4 * interval + 2).kv
        per = (more.compress_seconds - first.compress_seconds) / max(more.compressions - first.compressions, 1)
        held = budget + interval
        points.append((Shapes.compress_units(rows, held, budget, interval, policy), per / shapes.layers))
    compress_fixed, compress_unit = _line(*points[0], *points[1])
    return Rates(flop_rate, bandwidth, cached_token, max(step_fixed - weights, 0.0), sparse_overhead,
                 compress_fixed, compress_unit)
