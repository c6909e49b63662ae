"""Decode steps at the GPU's memory floor: the engine's static step (CUDA graphs) against the bytes a step must read.

    python bench/gpu_decode.py --out FILE.jsonl [--device cuda] [--deadline 420] [--compile-decode auto]
        [--warm-runs 1] [--only REGEX]
    python bench/gpu_decode.py --out /tmp/d.jsonl --device cpu --small          # the dry run tests/ runs

A Qwen2.5-1.5B-shaped model (28 layers, 12 query / 2 KV heads of 128, vocabulary 151,936) with random bf16 weights;
every row of a cell continues one prompt, and the cell decodes at position L (prompt L - new, new = 2Δ + 16 tokens),
B = L/8, Δ = L/64, window 8. Cells (L × rows): 4096 × 64, 4096 × 512, 8192 × 256, each with

- dense, R-KV and SnapKV at B, block-sparse attention attending B tokens (pages of 16, 2 dense layers), and the
  lossless sampler with a window draft and with a block draft (B tokens; γ adaptive);
- per cell: ms per decode step after the first compression (CUDA-synchronised wall clock between steps), tokens/s,
  the floor (weights + the KV the step reads, at the card's bandwidth), the ratio to dense's tokens/s, the host
  launches per step (CUDA runtime calls: kernel and graph launches, copies) and host reads per step (operators that
  wait for the device: item, nonzero, ...), both over 8 steps between compressions, the GPU kernels a step runs
  and their summed time (CUDA, from the profiler: a step replayed as one graph still runs every kernel in it), and
  the share of the rollout's time in compressions (the first, of the prompt, included);

then the equal-memory cell (R-KV rows in dense-512's KV bytes at 4k), HF `generate` (sdpa, DynamicCache) as the
peer at 4096 × 64, and the dense-vs-dense ξ baseline: the dense sampler's recorded log-probs against the learner's
forward of the same tokens, in bf16 and in float32 (in bf16, numerics alone move ξ). `--small` runs the same code on
a 2-layer model with short contexts (a CPU dry run, not a measurement). Each record is one JSON line in `--out`; a
Markdown table is printed at the end. Cells past `--deadline` seconds are skipped and said so; `--only REGEX` runs
the cells whose name matches (names as "rkv 4096x512", "equal memory", "hf generate", "xi torch.float32").
"""

from __future__ import annotations

import argparse
import time

import torch
from common import Recorder, qwen_shape
from transformers import AutoModelForCausalLM

from sparserl.model.clock import HostReads
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.speculative.drafts import WindowDraft
from sparserl.rollout.speculative.sampler import SpeculativeSampler

LAUNCHES = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernelExC", "cuLaunchKernel")
METHODS = ("dense", "rkv", "snapkv", "block", "spec-window", "spec-block")
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, by the card's name


class Bench(Recorder):
    def __init__(self, args):
        super().__init__(args.out, torch.device(args.device), args.deadline, args.only)
        self.args = args
        self.config = qwen_shape(args.small)
        if args.small:
            self.cells, self.equal, self.dtype = [(256, 4), (512, 8)], (256, 8, 16), torch.float32
        else:
            self.cells, self.equal, self.dtype = [(4096, 64), (4096, 512), (8192, 256)], (4096, 512, 2048), \
                torch.bfloat16
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype).eval()
        config = self.config
        self.kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * \
            (config.hidden_size // config.num_attention_heads) * self.dtype.itemsize
        self.weight_bytes = sum(p.numel() for p in self.model.parameters()) * self.dtype.itemsize
        name = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        self.bandwidth = next((b for card, b in BANDWIDTH.items() if card in name), 1e11 if self.cuda else 5e10)
        self.emit({"what": "setup", "device": name, "torch": torch.__version__, "dtype": str(self.dtype),
                   "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_per_token,
                   "bandwidth_assumed": self.bandwidth, "compile_decode": args.compile_decode,
                   "warm_runs": args.warm_runs})

    # --- a cell -----------------------------------------------------------------------------------------
    def sampler(self, method: str, budget: int, interval: int):
        if method == "spec-window":
            return SpeculativeSampler(self.model, WindowDraft(budget=budget, sink=min(64, budget // 4)), "adaptive")
        if method == "spec-block":
            return SpeculativeSampler(self.model, BlockSparsity(budget=budget, page_size=16, dense_layers=2),
                                      "adaptive")
        sparsity = {"dense": None, "block": BlockSparsity(budget=budget, page_size=16, dense_layers=2)}.get(
            method, KVCompression(method, budget=budget, window=8, interval=interval)) if method != "dense" else None
        return RolloutEngine(self.model, sparsity, record_evictions=False)

    def cell(self, method: str, length: int, rows: int, prompt_len: int | None = None) -> dict:
        budget, interval = length // 8, max(16, length // 64)
        new = 2 * interval + 16
        prompt_len = prompt_len or length - new
        generator = torch.Generator().manual_seed(length + rows)
        prompt = torch.randint(10, self.config.vocab_size - 10, (prompt_len,), generator=generator).tolist()
        sampling = SamplingConfig(new, 1.0, eos_token_id=None, pad_token_id=0, compile_decode=self.args.compile_decode)
        seeds = [request_seed(length * 1000 + rows, r) for r in range(rows)]
        stamps: list[float] = []
        first_timed = interval + 1  # the steps after the first compression
        window = (first_timed + 1, first_timed + 9)  # 8 steps between compressions, for the counts
        # torch.compile refuses to run under a dispatch mode, so a step compiled on the CPU (run compiled at every
        # step, not replayed) is not counted.
        counts = HostReads() if self.cuda or self.args.compile_decode != "true" else None
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        profiler = torch.profiler.profile(activities=activities) if self.cuda else None

        def on_step(_):
            self.sync()
            stamps.append(time.perf_counter())
            if len(stamps) == window[0]:
                if counts is not None:
                    counts.__enter__()
                if profiler is not None:
                    profiler.start()
            elif len(stamps) == window[1]:
                if counts is not None:
                    counts.__exit__(None, None, None)
                if profiler is not None:
                    profiler.stop()

        sampler = self.sampler(method, budget, interval)
        for _ in range(self.args.warm_runs):  # compilations and captures of every shape the timed run meets
            sampler.generate([prompt] * rows, sampling, seeds=seeds)
        self.reset_peak()
        self.sync()
        started = time.perf_counter()
        batch = sampler.generate([prompt] * rows, sampling, seeds=seeds, on_step=on_step)
        self.sync()
        rollout_s = time.perf_counter() - started
        record = {"what": "cell", "method": method, "L": length, "rows": rows, "prompt": prompt_len,
                  "budget": budget, "interval": interval, "new": new, "cell_s": rollout_s}
        measured = len(stamps) - window[1] if window[1] < len(stamps) else 0
        if counts is not None:
            record["host_reads_per_step"] = counts.reads / 8
            record["aten_ops_per_step"] = counts.ops / 8
        if profiler is not None and measured:
            events = profiler.key_averages()
            record["launches_per_step"] = sum(event.count for event in events if event.key in LAUNCHES) / 8
            kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
            record["gpu_kernels_per_step"] = sum(event.count for event in kernels) / 8
            record["gpu_kernel_ms_per_step"] = sum(event.self_device_time_total for event in kernels) / 8 / 1e3
            heaviest = sorted(kernels, key=lambda event: -event.self_device_time_total)[:8]
            record["heaviest_kernels"] = [(event.key[:80], event.count / 8, event.self_device_time_total / 8 / 1e3)
                                          for event in heaviest]  # (name, per step, ms per step)
        if method.startswith("spec"):
            stats = batch.speculation
            rounds = len(stamps)
            record.update(tokens=int(stats.tokens), acceptance=stats.acceptance_rate,
                          tokens_per_verification=stats.tokens / max(stats.verifications, 1),
                          decode_s=(stamps[-1] - stamps[0]) * rounds / max(rounds - 1, 1))
            record["step_ms"] = record["decode_s"] / max(int(stats.tokens) / rows, 1) * 1e3
        else:
            steps = len(stamps) - first_timed
            record.update(tokens=rows * steps, decode_s=stamps[-1] - stamps[first_timed - 1])
            record["step_ms"] = record["decode_s"] / steps * 1e3
            context = prompt_len + new if method in ("dense", "block") else budget + interval / 2
            read = budget if method == "block" else context  # block attention reads its pages only
            record["floor_step_ms"] = (self.weight_bytes + rows * read * self.kv_per_token) / self.bandwidth * 1e3
            record["compress_frac"] = batch.kv.compress_seconds / rollout_s
        record["tok_s"] = record["tokens"] / record["decode_s"]
        record["kv_peak_gib"] = batch.kv.kv_peak_bytes / 2**30
        if self.cuda:
            record["gpu_peak_gib"] = self.peak_gib()
        del batch, sampler
        if self.cuda:
            torch.cuda.empty_cache()
        return record

    # --- the peers and the baseline -----------------------------------------------------------------------
    def hf_generate(self, length: int, rows: int) -> dict:
        """HF generate, dense: the decode part's tokens/s, (t(new) - t(1)) / (new - 1)."""
        interval = max(16, length // 64)
        new = 2 * interval + 16
        generator = torch.Generator().manual_seed(length + rows)
        ids = torch.randint(10, self.config.vocab_size - 10, (1, length - new), generator=generator).repeat(rows, 1)
        ids = ids.to(self.device)
        seconds = {}
        for tokens in (1, new):
            self.sync()
            started = time.perf_counter()
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, min_new_tokens=tokens, max_new_tokens=tokens, pad_token_id=0)
            self.sync()
            seconds[tokens] = time.perf_counter() - started
        decode = seconds[new] - seconds[1]
        return {"what": "cell", "method": "hf-generate", "L": length, "rows": rows, "tokens": rows * (new - 1),
                "decode_s": decode, "tok_s": rows * (new - 1) / decode, "step_ms": decode / (new - 1) * 1e3}

    def xi_baseline(self, dtype: torch.dtype) -> dict:
        """The dense sampler against the learner's forward of its own tokens: ξ would be 1 in exact arithmetic."""
        model = self.model if dtype == self.dtype else self.model.to(dtype)
        rows, prompt_len, new = (8, 32, 32) if self.args.small else (64, 256, 256)
        generator = torch.Generator().manual_seed(11)
        prompts = torch.randint(10, self.config.vocab_size - 10, (rows, prompt_len), generator=generator).tolist()
        sampling = SamplingConfig(new, 1.0, eos_token_id=None, pad_token_id=0, compile_decode=self.args.compile_decode)
        batch = RolloutEngine(model, None, record_evictions=False).generate(
            prompts, sampling, seeds=[request_seed(11, r) for r in range(rows)])
        old = batched_logprobs(model, batch.input_ids, batch.attention_mask, prompt_len, 16, 1.0)
        xi = (old.double() - batch.sampler_logprobs.double()).exp()[batch.response_mask.bool()]
        quantiles = torch.quantile(xi, torch.tensor([0.001, 0.01, 0.5, 0.99, 0.999], dtype=torch.float64,
                                                    device=xi.device))
        if model is not self.model:
            self.model.to(self.dtype)
        return {"what": "xi-baseline", "dtype": str(dtype), "tokens": int(xi.numel()),
                "outside_0.9_1.1": float(((xi < 0.9) | (xi > 1.1)).double().mean()),
                "outside_0.99_1.01": float(((xi < 0.99) | (xi > 1.01)).double().mean()),
                "quantiles_0.001_0.01_0.5_0.99_0.999": quantiles.tolist()}

    # --- the run ----------------------------------------------------------------------------------------
    def run(self) -> None:
        with torch.no_grad():
            for length, rows in self.cells:
                for method in METHODS:
                    self.guarded(f"{method} {length}x{rows}", lambda: [self.cell(method, length, rows)])
            length, dense_rows, rkv_rows = self.equal

            def equal_memory() -> list[dict]:
                record = self.cell("rkv", length, rkv_rows, prompt_len=2 * (length // 8))
                record.update(what="equal-memory", dense_rows=dense_rows)
                return [record]

            self.guarded("equal memory", equal_memory)
            self.guarded("hf generate", lambda: [self.hf_generate(*self.cells[0])])
            for dtype in (self.dtype, torch.float32):
                self.guarded(f"xi {dtype}", lambda: [self.xi_baseline(dtype)])
        self.emit({"what": "done"})
        print(table(self.records))


def table(records: list[dict]) -> str:
    """The cells as Markdown: per L × rows, each method's step ms, floor, tokens/s and its ratio to dense's."""
    cells = [r for r in records if r.get("what") in ("cell", "equal-memory")]
    dense = {(r["L"], r["rows"]): r["tok_s"] for r in cells if r["method"] == "dense"}
    lines = ["| L × rows | method | step ms | floor ms | tok/s | × dense | launches/step | GPU kernels/step | "
             "kernel ms/step | host reads/step | compress share | acceptance |", "|" + "---|" * 12]
    for r in cells:
        base = dense.get((r["L"], r.get("dense_rows", r["rows"])))
        lines.append(
            f"| {r['L']} × {r['rows']}{' (equal memory)' if r['what'] == 'equal-memory' else ''} | {r['method']} | "
            f"{r['step_ms']:.2f} | {r.get('floor_step_ms', float('nan')):.2f} | {r['tok_s']:.0f} | "
            f"{r['tok_s'] / base if base else float('nan'):.2f} | {r.get('launches_per_step', float('nan')):.1f} | "
            f"{r.get('gpu_kernels_per_step', float('nan')):.0f} | {r.get('gpu_kernel_ms_per_step', float('nan')):.2f} | "
            f"{r.get('host_reads_per_step', float('nan')):.2f} | {r.get('compress_frac', float('nan')):.1%} | "
            f"{r.get('acceptance', float('nan')):.2f} |")
    for r in records:
        if r.get("what") == "xi-baseline":
            lines.append(f"\nξ baseline, dense sampler vs the learner's forward, {r['dtype']}: "
                         f"{r['outside_0.9_1.1']:.2%} of {r['tokens']} tokens outside [0.9, 1.1], "
                         f"{r['outside_0.99_1.01']:.2%} outside [0.99, 1.01]")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines, one per record (appended)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short contexts: a dry run")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after which cells are skipped")
    parser.add_argument("--compile-decode", default="auto", choices=("auto", "true", "false"),
                        help="auto: CUDA graphs of the step; true: the step compiled (Inductor), then captured")
    parser.add_argument("--warm-runs", type=int, default=0,
                        help="untimed rollouts of each cell first, so that no compilation falls in the timed steps")
    parser.add_argument("--only", default="", help="a regular expression: run only the cells whose name matches")
    args = parser.parse_args()
    if args.compile_decode == "true":  # every cell's shapes compile once in this one process
        torch._dynamo.config.recompile_limit = 256
    Bench(args).run()


if __name__ == "__main__":
    main()
