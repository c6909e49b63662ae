"""The paper's rollout, end to end: whole rollouts from short prompts to long answers, and one whole GRPO step.

    python bench/paper_rollout.py --out FILE.jsonl [--device cuda] [--prompts 64] [--deadline 540]
        [--compile-decode auto] [--only REGEX] [--step-prompts 16]
    python bench/paper_rollout.py --out /tmp/p.jsonl --device cpu --small     # the dry run tests/ runs

Sparse-RL's regime (its code): 256-token prompts, answers to 4,096 tokens (EOS suppressed here, so every row runs to
the end, the worst case for memory and the case the speed claim is about), 8 samples per prompt, budget B = 512,
compression every Δ = 128 decode steps, observation window 8. A Qwen2.5-1.5B-shaped model (28 layers, 12 query / 2 KV
heads of 128, vocabulary 151,936) with random bf16 weights.

1. **Rollouts**: dense, R-KV and SnapKV on the same prompts and per-row seeds, each from a cold sampler, so that the
   wall time holds everything a training run pays (compressions, CUDA-graph captures and compilations of every
   shape the rollout meets). Per method: wall seconds, response tokens/s and its ratio to dense's, peak KV bytes and
   KV saved (1 − sparse peak / dense peak on the same prompts), the share of the time in compressions, and the
   compilations and captures the sampler reports (`KVStats`), where it reports them. Then the same rollout again on
   the warm sampler (what every rollout after a run's first pays).
2. **One GRPO step** for dense and sparse-rl (`--step-prompts` prompts × 8, the same lengths): the rollout, π_old's
   teacher-forced recompute, the corrections (Sparse-RL's for the sparse step), one AdamW update over the batch in
   micro-batches; seconds per phase and the device's peak memory per phase. Rewards are random (seeded): the bench
   times the step, it does not train.

`--small` runs the same code on a 2-layer model with short lengths (a CPU dry run, not a measurement). Each record is
one JSON line in `--out`; Markdown tables are printed at the end. Cells past `--deadline` seconds are skipped and
said so.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from common import Recorder, qwen_shape
from transformers import AutoModelForCausalLM

from sparserl.config.corrections import CorrectionConfig
from sparserl.config.schema import TrainConfig
from sparserl.learner.corrections import compute_corrections
from sparserl.learner.grpo import group_advantages
from sparserl.learner.update import ppo_update
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.batch import SamplingConfig, kv_saved
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

METHODS = ("dense", "rkv", "snapkv")
GROUP = 8
# What the sampler may report of its static step (rollout/batch.py's KVStats), read where present.
STEP_COUNTS = ("compilations", "captures", "compile_seconds", "capture_seconds")


@dataclass(frozen=True)
class Regime:
    """The rollout's lengths and compression settings."""

    prompt: int
    new: int
    budget: int
    interval: int
    window: int = 8


PAPER = Regime(prompt=256, new=4096, budget=512, interval=128)
SMALL = Regime(prompt=32, new=192, budget=48, interval=16)


class Bench(Recorder):
    def __init__(self, args):
        super().__init__(args.out, torch.device(args.device), args.deadline, args.only)
        self.args = args
        self.config = qwen_shape(args.small)
        self.regime, self.dtype = (SMALL, torch.float32) if args.small else (PAPER, torch.bfloat16)
        torch.manual_seed(0)
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype).eval()
        self.initial = {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}
        name = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        self.emit({"what": "setup", "device": name, "torch": torch.__version__, "dtype": str(self.dtype),
                   "regime": vars(self.regime), "prompts": args.prompts, "group": GROUP,
                   "compile_decode": args.compile_decode})

    # --- the pieces ---------------------------------------------------------------------------------------
    def prompts(self, count: int) -> tuple[list[list[int]], list[int]]:
        """`count` prompts of the regime's length, each repeated GROUP times, and each row's seed."""
        generator = torch.Generator().manual_seed(count)
        vocab = self.config.vocab_size
        distinct = torch.randint(10, vocab - 10, (count, self.regime.prompt), generator=generator).tolist()
        rows = [prompt for prompt in distinct for _ in range(GROUP)]
        return rows, [request_seed(count, row) for row in range(len(rows))]

    def engine(self, method: str) -> RolloutEngine:
        regime = self.regime
        sparsity = None if method == "dense" else KVCompression(
            method, budget=regime.budget, window=regime.window, interval=regime.interval)
        return RolloutEngine(self.model, sparsity, record_evictions=False)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.regime.new, 1.0, eos_token_id=None, pad_token_id=0,
                              compile_decode=self.args.compile_decode)

    def timed_rollout(self, engine: RolloutEngine, rows, seeds):
        self.sync()
        started = time.perf_counter()
        batch = engine.generate(rows, self.sampling(), seeds=seeds)
        self.sync()
        return batch, time.perf_counter() - started

    # --- 1. rollouts --------------------------------------------------------------------------------------
    def rollouts(self, method: str):
        rows, seeds = self.prompts(self.args.prompts)
        engine = self.engine(method)
        self.reset_peak()
        for run in ("cold", "warm"):
            batch, seconds = self.timed_rollout(engine, rows, seeds)
            kv = batch.kv
            tokens = int(batch.response_lengths.sum())
            record = {"what": "rollout", "method": method, "run": run, "rows": len(rows), "seconds": seconds,
                      "tokens": tokens, "tok_s": tokens / seconds, "kv_peak_bytes": kv.kv_peak_bytes,
                      "compress_share": kv.compress_seconds / seconds, "compressions": kv.compressions,
                      "gpu_peak_gib": self.peak_gib()}
            record.update({name: getattr(kv, name) for name in STEP_COUNTS if hasattr(kv, name)})
            del batch
            yield record

    # --- 2. one GRPO step ---------------------------------------------------------------------------------
    def grpo_step(self, mode: str):
        method, correction = ("dense", CorrectionConfig.off()) if mode == "dense" else \
            ("rkv", CorrectionConfig.sparse_rl())
        self.model.load_state_dict(self.initial)  # each step from the same weights
        rows, seeds = self.prompts(self.args.step_prompts)
        phases, peaks = {}, {}

        def phase(name: str, work):
            self.reset_peak()
            self.sync()
            started = time.perf_counter()
            result = work()
            self.sync()
            phases[name], peaks[name] = time.perf_counter() - started, self.peak_gib()
            return result

        micro = self.args.micro_batch
        batch = phase("rollout", lambda: self.engine(method).generate(rows, self.sampling(), seeds=seeds))
        width = batch.prompt_ids.shape[1]
        logp_old = phase("recompute", lambda: batched_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                                               width, micro, 1.0))
        corrections = compute_corrections(logp_old, batch.sampler_logprobs, batch.response_mask, correction)
        rewards = torch.rand(len(rows), generator=torch.Generator().manual_seed(1)).to(self.device)
        advantages = group_advantages(rewards, GROUP).to(logp_old.dtype)
        train = TrainConfig(minibatches=1, epochs=1, kl_coef=0.0, micro_batch_size=micro, share_prompts=True)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        generator = torch.Generator(device=self.device).manual_seed(0)
        phase("update", lambda: ppo_update(self.model, optimizer, batch, logp_old, None, advantages,
                                           corrections.weights, corrections.keep_mask, generator, train, 1.0))
        optimizer = None  # its states freed before the next step's rollout
        total = sum(phases.values())
        yield {"what": "grpo-step", "mode": mode, "rows": len(rows), "tokens": int(batch.response_lengths.sum()),
               "step_s": total, **{f"{name}_s": seconds for name, seconds in phases.items()},
               **{f"{name}_gpu_peak_gib": peak for name, peak in peaks.items()},
               "kv_peak_bytes": batch.kv.kv_peak_bytes,
               "kept_token_frac": float(corrections.keep_mask.sum() / batch.response_mask.sum())}

    def run(self) -> None:
        for method in METHODS:
            with torch.no_grad():
                self.guarded(f"rollout {method}", lambda: self.rollouts(method))
        for mode in ("dense", "sparse-rl"):
            self.guarded(f"grpo {mode}", lambda: self.grpo_step(mode))
        self.emit({"what": "done"})
        print(tables(self.records))


def tables(records: list[dict]) -> str:
    """The rollouts and the GRPO steps as Markdown, each against dense's figure of the same run."""
    rollouts = [r for r in records if r.get("what") == "rollout"]
    dense = {r["run"]: r for r in rollouts if r["method"] == "dense"}
    lines = ["| method | run | seconds | tok/s | × dense | KV peak GiB | KV saved | compress share | "
             "compilations | captures |", "|" + "---|" * 10]
    for r in rollouts:
        base = dense.get(r["run"])
        lines.append(
            f"| {r['method']} | {r['run']} | {r['seconds']:.1f} | {r['tok_s']:.0f} | "
            f"{r['tok_s'] / base['tok_s'] if base else float('nan'):.2f} | {r['kv_peak_bytes'] / 2**30:.2f} | "
            f"{kv_saved(r['kv_peak_bytes'], base['kv_peak_bytes']) if base else float('nan'):.1%} | "
            f"{r['compress_share']:.1%} | {r.get('compilations', '—')} | {r.get('captures', '—')} |")
    steps = [r for r in records if r.get("what") == "grpo-step"]
    if steps:
        dense_step = next((r for r in steps if r["mode"] == "dense"), None)
        lines += ["", "| GRPO step | rows | step s | × dense (speed) | rollout s | recompute s | update s | "
                  "peak GiB (rollout / recompute / update) |", "|" + "---|" * 8]
        for r in steps:
            speed = dense_step["step_s"] / r["step_s"] if dense_step else float("nan")
            peaks = " / ".join("—" if r.get(f"{p}_gpu_peak_gib") is None else f"{r[f'{p}_gpu_peak_gib']:.1f}"
                               for p in ("rollout", "recompute", "update"))
            lines.append(f"| {r['mode']} | {r['rows']} | {r['step_s']:.1f} | {speed:.2f} | {r['rollout_s']:.1f} | "
                         f"{r['recompute_s']:.1f} | {r['update_s']:.1f} | {peaks} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines, one per record (appended)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short lengths: a dry run")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the rollouts (8 samples each)")
    parser.add_argument("--step-prompts", type=int, default=16, help="prompts of the GRPO step (8 samples each)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per forward in π_old and the update")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds after which cells are skipped")
    parser.add_argument("--compile-decode", default="auto", choices=("auto", "true", "false"))
    parser.add_argument("--only", default="", help="a regular expression: run only the cells whose name matches")
    args = parser.parse_args()
    Bench(args).run()


if __name__ == "__main__":
    main()
