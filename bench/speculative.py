"""Does a lossless speculative rollout beat dense decoding on this machine? (issue 26)

    python bench/speculative.py --threads 1 [--lengths 512,1024,2048,4096] [--batch 32] [--budget-frac 0.25]
                                [--speculative block:4,window:4,window:8,window:adaptive] [--no-lossy]
                                [--warm-only | --no-warm] [--json FILE]

Part 1, speed: the random built-in architecture (`builtin_model_config(97)`, 8192 positions, float32),
a batch of --batch rows, each a 64-token random prompt plus exactly L − 64 sampled tokens (EOS off),
per-row seeds. Rows:
- dense: `RolloutEngine(model)`;
- lossy sparse: `RolloutEngine` with block-sparse attention at B = L/4 (pages of 16, every layer sparse),
  and with R-KV at B = L/4 (window 8, interval max(8, L/32)) as in bench/rollout.py;
- speculative (lossless): `SpeculativeSampler` for each --speculative DRAFT:γ, drafting with that
  block-sparse attention (`block`) or with a window of the same B slots, the 64 prompt slots and the
  B − 64 most recent (`window`).
Tokens/s is generated tokens / rollout seconds (prefill included); speedup against dense at the same L,
by wall time and by the process's CPU time (`time.process_time`, one thread): on a shared machine the
wall time also counts the waits for a core, the CPU time much less so (memory bandwidth stays shared).
Random weights give near-uniform attention and next-token distributions, so a sparse draft is
accepted almost always there: the acceptance rate of part 1 is optimistic, not a property of a
trained model.

Part 2, acceptance on a trained model: the warm-started built-in model (`load_policy(None)`) on
pointer-walk prompts at its own lengths (prompts 36–56, responses up to 78 tokens), temperature 1,
γ = 4: the acceptance rate and α of the draft at several budgets B, block-sparse with the dense
layers the config uses (2) and with none, and a window of B slots (the first 16 and the B − 16 most
recent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from common import compression_interval, contention_probe
from transformers import LlamaForCausalLM

from sparserl.model.loading import builtin_model_config, load_policy
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.speculative.drafts import WindowDraft
from sparserl.rollout.speculative.sampler import SpeculativeSampler
from sparserl.tasks.pointer_walk import PointerWalkTask

PROMPT_LEN = 64
PAGE = 16


def speed_rows(model, length: int, batch: int, speculative: list[str], budget_frac: float,
               lossy: bool) -> list[dict]:
    """Dense, the lossy sparse samplers and each speculative `draft:γ` at total length `length`."""
    generator = torch.Generator().manual_seed(length)
    prompts = torch.randint(3, 97, (batch, PROMPT_LEN), generator=generator).tolist()
    sampling = SamplingConfig(max_new_tokens=length - PROMPT_LEN, temperature=1.0, eos_token_id=None)
    seeds = list(range(batch))
    budget = max(3 * PAGE, int(length * budget_frac) // PAGE * PAGE)
    block = BlockSparsity(budget=budget, page_size=PAGE, dense_layers=0)
    samplers = [("dense", RolloutEngine(model, record_evictions=False))]
    if lossy:
        samplers += [(f"block B={budget} (lossy)", RolloutEngine(model, block, record_evictions=False)),
                     (f"rkv B={length // 4} (lossy)",
                      RolloutEngine(model, KVCompression("rkv", length // 4, 8, compression_interval(length)),
                                    record_evictions=False))]
    drafts_by_name = {"block": block, "window": WindowDraft(budget=budget, sink=PROMPT_LEN)}
    for spec in speculative:
        name, gamma = spec.split(":")
        samplers.append((f"spec {name} γ={gamma}",
                         SpeculativeSampler(model, drafts_by_name[name], gamma if gamma == "adaptive" else int(gamma))))
    rows = []
    for name, sampler in samplers:
        cpu_started = time.process_time()
        rollout = sampler.generate(prompts, sampling, seeds=seeds)
        cpu_seconds = time.process_time() - cpu_started
        tokens = float(rollout.response_mask.sum())
        row = {"L": length, "sampler": name, "tok_s": tokens / rollout.rollout_seconds,
               "seconds": rollout.rollout_seconds, "cpu_seconds": cpu_seconds, "tok_cpu_s": tokens / cpu_seconds}
        if isinstance(sampler, SpeculativeSampler):
            stats = rollout.speculation
            row.update(acceptance=stats.acceptance_rate, tokens_per_verification=stats.tokens / stats.verifications,
                       gamma_mean=stats.gamma_sum / stats.rounds, draft_s=stats.draft_seconds,
                       verify_s=stats.verify_seconds, attended=stats.attended_frac)
        rows.append(row)
        print(_speed_line(row, rows[0]), flush=True)
    return rows


def _speed_line(row: dict, dense: dict) -> str:
    extra = (f"{row['acceptance']:.3f} | {row['tokens_per_verification']:.2f} | {row['gamma_mean']:.1f} | "
             f"{row['draft_s']:.1f} | {row['verify_s']:.1f} | {row['attended']:.2f}") if "acceptance" in row \
        else " |  |  |  |  | "
    return (f"| {row['L']} | {row['sampler']} | {row['tok_s']:.0f} | {row['seconds']:.1f} | "
            f"{row['tok_s'] / dense['tok_s']:.2f}x | {row['cpu_seconds']:.1f} | "
            f"{row['tok_cpu_s'] / dense['tok_cpu_s']:.2f}x | {extra} |")


def warm_rows(budgets: list[int], rows: int) -> list[dict]:
    """Acceptance of each draft on the warm-started built-in model, pointer-walk prompts."""
    model, tokenizer = load_policy(None)
    task = PointerWalkTask()
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples(rows, seed=0, split="test")]
    sampling = SamplingConfig(max_new_tokens=task.default_max_new_tokens, temperature=1.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    drafts = [(f"block, {layers} dense layers", budget,
               BlockSparsity(budget=budget, page_size=PAGE, dense_layers=layers))
              for layers in (2, 0) for budget in budgets]
    drafts += [("window, sink 16", budget, WindowDraft(budget=budget, sink=16)) for budget in budgets]
    results = []
    for name, budget, draft in drafts:
        sampler = SpeculativeSampler(model, draft, 4)
        rollout = sampler.generate(prompts, sampling, seeds=list(range(rows)))
        metrics = rollout.speculation.metrics(PAGE)
        row = {"draft": name, "budget": budget,
               "acceptance": metrics["spec_acceptance_rate"], "alpha_mean": metrics["spec_alpha_mean"],
               "alpha_tail": metrics.get("spec_alpha_tail", float("nan")),
               "tokens_per_verification": metrics["spec_tokens_per_verification"],
               "attended": metrics["spec_draft_attended_frac"],
               "response_len_mean": float(rollout.response_lengths.float().mean())}
        results.append(row)
        print(f"| {name} | {budget} | {row['attended']:.2f} | {row['acceptance']:.3f} | "
              f"{row['alpha_mean']:.3f} | {row['alpha_tail']:.3f} | {row['tokens_per_verification']:.2f} | "
              f"{row['response_len_mean']:.0f} |", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--speculative", default="block:4,window:4,window:8,window:adaptive",
                        help="speculative rows: DRAFT:GAMMA, DRAFT block (Sparrow) or window, GAMMA a count|adaptive")
    parser.add_argument("--no-lossy", action="store_true", help="leave out the lossy sparse rows")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each length's rows this many times, one set after the other (interleaved), "
                             "each against its own dense row: on a shared machine the load drifts")
    parser.add_argument("--budget-frac", type=float, default=0.25, help="the draft's block budget B = L x this")
    parser.add_argument("--warm-budgets", default="48,64,80")
    parser.add_argument("--warm-rows", type=int, default=128)
    parser.add_argument("--warm-only", action="store_true")
    parser.add_argument("--no-warm", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {args.threads} thread(s), load {os.getloadavg()[0]:.2f} at start, "
          f"contention probe {contention_probe(args.threads):.3f} ms", flush=True)
    results: dict = {"args": vars(args), "load_start": os.getloadavg()}
    if not args.warm_only:
        torch.manual_seed(0)
        model = LlamaForCausalLM(builtin_model_config(97, max_position_embeddings=8192)).eval()
        print("\n| L | sampler | tok/s | rollout s | vs dense | CPU s | vs dense (CPU) | acceptance | "
              "tokens/verification | γ mean | draft s | verify s | draft attended |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        results["speed"] = [dict(row, repeat=repeat) for length in map(int, args.lengths.split(","))
                            for repeat in range(args.repeats)
                            for row in speed_rows(model, length, args.batch, args.speculative.split(","),
                                                  args.budget_frac, not args.no_lossy)]
    if not args.no_warm:
        print("\nWarm-started built-in model, pointer-walk prompts, temperature 1, γ = 4\n\n"
              "| draft | B | draft attended | acceptance | α mean | α tail | tokens/verification | "
              "response len |\n|---|---|---|---|---|---|---|---|")
        results["warm"] = warm_rows([int(b) for b in args.warm_budgets.split(",")], args.warm_rows)
    results["load_end"] = os.getloadavg()
    print(f"\nload {os.getloadavg()[0]:.2f} at end, contention probe {contention_probe(args.threads):.3f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
