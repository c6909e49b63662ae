"""Time our rollout engine, dense against every sparse KV policy (and HF `generate`), in one run.

    python bench/rollout.py --threads 1 [--quick] [--models builtin,30m] [--lengths 512,1024,2048,4096]
                            [--policies h2o,pyramidkv,rkv,snapkv,streamingllm] [--lengths-30m 4096]
                            [--policies-30m ...] [--hf-30m] [--block-dense-layers 2,0] [--batch 32] [--json FILE]
                            [--profile MODEL:L:POLICY] [--stress | --stress-only | --main-job] [--repeats 7]

For each model and each total length L (prompt + response), every row of a batch of --batch rows gets
a prompt of 64 random tokens and samples exactly L - 64 response tokens (EOS disabled), with:
- dense: `RolloutEngine(model, None)`;
- each KV policy at B = L/4: `KVCompression(policy, budget=L//4, window=8, interval=max(8, L//32))`;
- block-sparse attention at the same B (`--block-dense-layers`, builtin model only): full KV kept, each
  decode step of a sparse layer attends to B/16 pages of 16 tokens, `BlockSparsity(budget=L//4, page_size=16,
  dense_layers=d)` for each d given (row `block dD`); the `attended` column is `kv.attended_frac`;
- the reference setting (Sparse-RL): rkv at B=512, interval 128, window 8, at L = 4096 only;
- HF `model.generate` on the same model and prompts (do_sample, temperature 1, no top-k/top-p,
  min_new_tokens = max_new_tokens = L - 64, use_cache) as a peer for the dense engine.
`--stress` (or `--stress-only`) adds the stress regime at equal batch: the warm-started built-in model, 8
pointer-walk prompts x 8 samples with per-row seeds, EOS off, dense against every KV policy at B = 56 (the
config's window and interval), `--repeats` interleaved rounds; it reports ms per decode step, the per-round
ratio sparse/dense (goal for R-KV, the stress regime's policy: at most 1.05x) and the compression share.
`--main-job` times the main job's sampler the same way instead: the config's budget (80) with EOS on, so rows end
and leave the batch as in training; rollout seconds, tokens generated and the ratio to dense (goal for R-KV, the main
job's policy: at most 1.00x).

Models (random init with --seed, float32; we measure speed and memory, not quality):
- builtin: `sparserl.model.loading.builtin_model_config(97)` (0.6M parameters) with max_position_embeddings 8192;
- 30m: a Llama with hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1920, tied embeddings, vocab 97
  (the char tokenizer): 29.9M parameters.

Per row: peak KV bytes (`batch.kv.kv_peak_bytes`, the cache buffers' own nbytes; transient tensors of the
scoring, e.g. R-KV's [N, Hkv, L, 128] similarity blocks, are not counted), the dense KV bytes of the same
rollout (`kv_dense_bytes`), their ratio against the bound (B + interval) / L, decode tokens/s (generated
tokens / `rollout_seconds`, prefill included), speedup against the dense row of the same model and L, the
share of the rollout spent compressing (`kv.compress_seconds / rollout_seconds`), and for the dense row
our tokens/s over HF generate's. Each configuration runs once (after one untimed warm-up per model);
eviction records are off (`record_evictions=False`, as the trainer runs).

Time: the 30m model decodes at only ~300-600 tokens/s on one core (its matmuls, 1.9 GFLOP per step at
batch 32, dominate), so one 30m rollout at L=4096 takes 7-10 minutes and HF generate there ~15. To keep
the full default run near 25 minutes at --threads 1 on the 2-core bench machine (one run took 28: 1666 s,
992 of them for the two 30m rows), the 30m model runs a reduced set: L=4096 only (--lengths-30m), dense
and the rkv reference row, no B=L/4 policies (--policies-30m) and no HF generate (--hf-30m). The builtin model runs every policy at every length.
`--quick` (builtin, L 512 and 1024, about 1 minute) is the smoke run.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import logging
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
from common import compression_interval, contention_probe

PROMPT_LEN = 64
WINDOW = 8
REFERENCE = {"policy": "rkv", "budget": 512, "interval": 128, "length": 4096}
BLOCK_PAGE = 16
ALL_MODELS = ("builtin", "30m")


def parse_args(argv=None) -> argparse.Namespace:
    from sparserl.rollout.sparsity.policies import POLICIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="builtin,30m", help="comma list of builtin,30m (default both)")
    p.add_argument("--lengths", default="512,1024,2048,4096", help="total lengths L = 64 + response (default 512..4096)")
    p.add_argument("--policies", default=",".join(sorted(POLICIES)),
                   help="KV policies at B = L/4 for the builtin model (default all registered)")
    p.add_argument("--lengths-30m", default="4096",
                   help="total lengths for the 30m model (default 4096 only, to fit the time budget)")
    p.add_argument("--policies-30m", default="",
                   help="KV policies at B = L/4 for the 30m model (default none: dense + the rkv reference row only)")
    p.add_argument("--hf-30m", action="store_true",
                   help="also run HF generate on the 30m model (off by default: ~15 min at L=4096)")
    p.add_argument("--block-dense-layers", default="",
                   help="block-sparse rows at B = L/4 for the builtin model, one per count of dense first layers "
                        "(comma list, e.g. 2,0; default none)")
    p.add_argument("--batch", type=int, default=32, help="rows per rollout, 32..64 (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate peer rows")
    p.add_argument("--no-reference", action="store_true", help="skip the B=512, interval 128 rkv row at L=4096")
    p.add_argument("--quick", action="store_true", help="smoke run: builtin model, L in {512, 1024}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--profile", default=None, metavar="MODEL:L:POLICY",
                   help="after the table, cProfile one sparse rollout (B = L/4), e.g. builtin:2048:rkv")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--stress", action="store_true",
                   help="also time the stress regime at equal batch: the warm-started built-in model, 8 pointer-walk "
                        "prompts x 8 samples, EOS off, dense against every KV policy at B = 56 (--repeats interleaved rounds)")
    p.add_argument("--stress-only", action="store_true", help="only the stress-regime comparison (no L table)")
    p.add_argument("--main-job", action="store_true",
                   help="only the main job's sampler at equal batch: as --stress, but at the config's budget (80) "
                        "with EOS on (no L table)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds of --stress / --main-job (default 7)")
    args = p.parse_args(argv)
    args.stress = args.stress or args.stress_only
    if not 32 <= args.batch <= 64:
        p.error("--batch must be in 32..64")
    if args.quick:
        args.models, args.lengths = "builtin", "512,1024"
    args.model_list = [m for m in args.models.split(",") if m]
    for m in args.model_list:
        if m not in ALL_MODELS:
            p.error(f"unknown model {m!r}; choose from {ALL_MODELS}")
    args.length_lists = {"builtin": [int(x) for x in args.lengths.split(",") if x],
                         "30m": [int(x) for x in args.lengths_30m.split(",") if x]}
    for length in args.length_lists["builtin"] + args.length_lists["30m"]:
        if length <= PROMPT_LEN or length % 32:
            p.error(f"length {length} must be a multiple of 32 above {PROMPT_LEN}")
    args.block_list = [int(x) for x in args.block_dense_layers.split(",") if x]
    args.policy_lists = {"builtin": [x for x in args.policies.split(",") if x],
                         "30m": [x for x in args.policies_30m.split(",") if x]}
    for names in args.policy_lists.values():
        for name in names:
            if name not in POLICIES:
                p.error(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return args


# ---------------------------------------------------------------------------------------- models
def build_model(name: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparserl.model.loading import builtin_model_config
    from sparserl.tasks.tokenizer import build_char_tokenizer

    vocab = len(build_char_tokenizer())
    if name == "builtin":
        config = builtin_model_config(vocab, max_position_embeddings=8192)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1920, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
                             rope_theta=10000.0, tie_word_embeddings=True, pad_token_id=0,
                             eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.config.use_cache = True
    return model


def eos_id() -> int:
    from sparserl.tasks.tokenizer import EOS_TOKEN, build_char_tokenizer

    return build_char_tokenizer().convert_tokens_to_ids(EOS_TOKEN)


def make_prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, PROMPT_LEN), generator=g).tolist()


# ---------------------------------------------------------------------------------------- runs
def run_ours(model, prompts, length: int, comp, seed: int) -> dict:
    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine

    engine = RolloutEngine(model, comp, record_evictions=False)
    sampling = SamplingConfig(max_new_tokens=length - PROMPT_LEN, temperature=1.0, eos_token_id=None)
    gc.collect()
    batch = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
    tokens = int(batch.response_lengths.sum())
    if tokens != len(prompts) * (length - PROMPT_LEN):
        raise RuntimeError(f"expected every row to reach L={length}, got {tokens} tokens")
    kv = batch.kv
    return {"tokens": tokens, "rollout_s": batch.rollout_seconds, "tokens_per_s": tokens / batch.rollout_seconds,
            "peak_bytes": kv.kv_peak_bytes, "dense_bytes": kv.kv_dense_bytes,
            "compressions": kv.compressions, "compress_s": kv.compress_seconds,
            "compress_share": kv.compress_seconds / batch.rollout_seconds, "attended": kv.attended_frac}


def run_hf(model, prompts, length: int, seed: int, eos: int) -> dict:
    new = length - PROMPT_LEN
    input_ids = torch.tensor(prompts, dtype=torch.long)
    torch.manual_seed(seed)
    gc.collect()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                             use_cache=True, pad_token_id=0, eos_token_id=eos)
    seconds = time.perf_counter() - started
    tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    if tokens != len(prompts) * new:
        raise RuntimeError(f"HF generate made {tokens} tokens, expected {len(prompts) * new}")
    return {"tokens": tokens, "rollout_s": seconds, "tokens_per_s": tokens / seconds}


def configs_for(args, model_name: str, length: int):
    """(label, policy, budget, interval) for every row of one (model, L); policy None = dense, 'hf' = HF,
    'block' = block-sparse attention (its 'interval' slot holds the number of dense first layers)."""
    rows = [("dense", None, None, None)]
    interval = compression_interval(length)
    for policy in args.policy_lists[model_name]:
        rows.append((policy, policy, length // 4, interval))
    if model_name == "builtin":
        rows += [(f"block d{d}", "block", length // 4, d) for d in args.block_list]
    if not args.no_reference and length == REFERENCE["length"]:
        rows.append((f"{REFERENCE['policy']} ref", REFERENCE["policy"], REFERENCE["budget"], REFERENCE["interval"]))
    if hf_enabled(args, model_name):
        rows.append(("HF generate", "hf", None, None))
    return rows


def hf_enabled(args, model_name: str) -> bool:
    return not args.no_hf and (model_name == "builtin" or args.hf_30m)


def make_sparsity(policy: str | None, budget: int | None, interval: int | None):
    """The engine's sparsity for one row: None (dense), a BlockSparsity, or a KVCompression."""
    from sparserl.rollout.sparsity.block_sparse import BlockSparsity
    from sparserl.rollout.sparsity.eviction import KVCompression

    if policy is None:
        return None
    if policy == "block":
        return BlockSparsity(budget=budget, page_size=BLOCK_PAGE, dense_layers=interval)
    return KVCompression(policy, budget=budget, window=WINDOW, interval=interval)


def warm_up(model, model_name: str, args, eos: int) -> None:
    """One short untimed rollout of each kind, so first-call costs stay out of the table."""
    prompts = make_prompts(args.batch, model.config.vocab_size, args.seed + 999)
    run_ours(model, prompts, 192, None, 0)
    run_ours(model, prompts, 192, make_sparsity("rkv", 64, 16), 0)
    if model_name == "builtin" and args.block_list:
        run_ours(model, prompts, 192, make_sparsity("block", 64, 0), 0)
    if hf_enabled(args, model_name):
        run_hf(model, prompts, 96, 0, eos)


def bench(args) -> list[dict]:
    from sparserl.model.loading import count_parameters

    eos = eos_id()
    rows: list[dict] = []
    for model_name in args.model_list:
        model = build_model(model_name, args.seed)
        params = count_parameters(model)
        print(f"# model {model_name}: {params:,} parameters ({params / 1e6:.2f}M), "
              f"{model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
              f"{model.config.num_attention_heads} heads / {model.config.num_key_value_heads} KV heads, "
              f"HF attention {model.config._attn_implementation}", file=sys.stderr, flush=True)
        warm_up(model, model_name, args, eos)
        for length in args.length_lists[model_name]:
            prompts = make_prompts(args.batch, model.config.vocab_size, args.seed + length)
            dense = None
            for label, policy, budget, interval in configs_for(args, model_name, length):
                torch.set_num_threads(args.threads)
                if policy == "hf":
                    r = run_hf(model, prompts, length, args.seed, eos)
                else:
                    r = run_ours(model, prompts, length, make_sparsity(policy, budget, interval), args.seed)
                r.update(model=model_name, params=params, length=length, config=label,
                         policy=policy, budget=budget, interval=interval)
                if policy is None:
                    dense = r
                elif policy == "hf":
                    dense["vs_hf"] = dense["tokens_per_s"] / r["tokens_per_s"]
                    r["speedup"] = r["tokens_per_s"] / dense["tokens_per_s"]
                else:
                    r["ratio"] = r["peak_bytes"] / r["dense_bytes"]
                    if policy != "block":  # block attention keeps the whole cache: no memory bound
                        r["bound"] = (budget + interval) / length
                        r["within_bound"] = r["peak_bytes"] <= 1.1 * r["bound"] * r["dense_bytes"]
                    r["speedup"] = r["tokens_per_s"] / dense["tokens_per_s"]
                rows.append(r)
                print(f"# {model_name} L={length} {label}: {r['tokens_per_s']:.0f} tok/s, {r['rollout_s']:.1f} s"
                      + (f", compress {r['compress_share']:.1%}" if policy not in (None, "hf", "block") else "")
                      + (f", attended {r['attended']:.3f}" if policy == "block" else ""),
                      file=sys.stderr, flush=True)
        del model
        gc.collect()
    return rows


# ---------------------------------------------------------------------------------------- report
MIB = 2 ** 20


def table(rows: list[dict], args, reduced: bool) -> str:
    caption = (f"Rollout, batch {args.batch}, prompt {PROMPT_LEN} random tokens + L-{PROMPT_LEN} sampled tokens "
               f"(EOS off), float32, {args.threads} torch thread(s), one run per row; sparse rows: "
               f"B = L/4, window {WINDOW}, interval Δ = max(8, L/32) (16/32/64/128 at L = 512/1024/2048/4096); "
               f"`rkv ref` = B 512, Δ 128, w {WINDOW} at L = 4096.")
    if args.block_list:
        caption += (f" `block dD`: block-sparse attention, full KV kept, B/{BLOCK_PAGE} pages of {BLOCK_PAGE} "
                    f"tokens attended per step in every layer but the first D; `attended` = attended / cached "
                    f"real keys (mean over steps and sparse layers).")
    if "30m" in args.model_list:
        def describe(m):
            parts = [f"L {'/'.join(map(str, args.length_lists[m]))}", "dense"]
            parts += args.policy_lists[m]
            if not args.no_reference and REFERENCE["length"] in args.length_lists[m]:
                parts.append("rkv ref")
            if hf_enabled(args, m):
                parts.append("HF generate")
            return ", ".join(parts)
        caption += f" Rows per model: builtin: {describe('builtin')}; 30m: {describe('30m')}"
        if reduced:
            caption += " (30m reduced to fit the ~25 min budget at 1 thread)"
        caption += "."
    lines = [caption, "",
             "| model | L | config | B | Δ | peak KV MiB | dense KV MiB | peak/dense | bound (B+Δ)/L | ≤ 1.1×bound "
             "| tok/s | rollout s | speedup vs dense | compress share | dense / HF |"
             + (" attended |" if args.block_list else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.block_list else "")]
    for r in rows:
        sparse = r["policy"] not in (None, "hf")
        hf = r["policy"] == "hf"
        evicting = sparse and r["policy"] != "block"
        cells = [r["model"], str(r["length"]), r["config"],
                 str(r["budget"]) if sparse else "", str(r["interval"]) if evicting else "",
                 "" if hf else f"{r['peak_bytes'] / MIB:.1f}", "" if hf else f"{r['dense_bytes'] / MIB:.1f}",
                 f"{r['ratio']:.3f}" if sparse else "", f"{r['bound']:.3f}" if evicting else "",
                 ("yes" if r["within_bound"] else "**no**") if evicting else "",
                 f"{r['tokens_per_s']:.0f}", f"{r['rollout_s']:.1f}",
                 f"{r['speedup']:.2f}x" if "speedup" in r else "",
                 f"{r['compress_share']:.1%}" if evicting else "",
                 f"{r['vs_hf']:.2f}x" if "vs_hf" in r else ""]
        if args.block_list:
            cells.append(f"{r['attended']:.3f}" if r["policy"] == "block" else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_line(name: str, checks: list[tuple[str, bool, str]]) -> str:
    if not checks:
        return f"- {name}: not measured in this run"
    met = sum(ok for _, ok, _ in checks)
    verdict = "MET" if met == len(checks) else "NOT MET"
    misses = [f"{label} ({detail})" for label, ok, detail in checks if not ok]
    line = f"- {name}: **{verdict}** ({met}/{len(checks)} rows)"
    if misses:
        line += "; misses: " + "; ".join(misses)
    return line


def goals(rows: list[dict]) -> tuple[str, dict]:
    sparse = [r for r in rows if r["policy"] not in (None, "hf", "block")]
    dense = [r for r in rows if r["policy"] is None and "vs_hf" in r]
    label = lambda r: f"{r['model']} L={r['length']} {r['config']}"  # noqa: E731
    summary: dict = {}

    peak = [(label(r), r["within_bound"], f"peak/dense {r['ratio']:.3f} vs 1.1×bound {1.1 * r['bound']:.3f}")
            for r in sparse]
    worst = max((r["ratio"] / r["bound"] for r in sparse), default=float("nan"))
    summary["peak_bound"] = {"met": sum(c[1] for c in peak), "rows": len(peak), "worst_peak_over_bound": worst}

    long = [r for r in sparse if r["length"] >= 4 * r["budget"]]
    faster = [(label(r), r["speedup"] >= 1.0, f"{r['speedup']:.2f}x") for r in long]
    summary["sparse_ge_dense"] = {"met": sum(c[1] for c in faster), "rows": len(faster),
                                  "min_speedup": min((r["speedup"] for r in long), default=float("nan"))}

    at4096 = [r for r in sparse if r["length"] == 4096]
    x15 = [(label(r), r["speedup"] >= 1.5, f"{r['speedup']:.2f}x") for r in at4096]
    summary["speedup_1.5_at_4096"] = {"met": sum(c[1] for c in x15), "rows": len(x15),
                                      "speedups": {label(r): r["speedup"] for r in at4096}}

    share = [(label(r), r["compress_share"] <= 0.10, f"{r['compress_share']:.1%}") for r in sparse]
    summary["compress_share_le_10pct"] = {"met": sum(c[1] for c in share), "rows": len(share),
                                          "max_share": max((r["compress_share"] for r in sparse), default=float("nan"))}

    hf = [(f"{r['model']} L={r['length']}", r["vs_hf"] >= 1.0, f"{r['vs_hf']:.2f}x") for r in dense]
    summary["dense_ge_hf"] = {"met": sum(c[1] for c in hf), "rows": len(hf),
                              "ratios": {f"{r['model']} L={r['length']}": r["vs_hf"] for r in dense}}

    def span(values):
        values = list(values)
        return f"{min(values):.2f}x..{max(values):.2f}x" if values else "n/a"

    lines = ["Goals:",
             goal_line(f"1. peak KV ≤ 1.1 × (B+Δ)/L × dense (worst peak/(bound×dense) = {worst:.3f})", peak),
             goal_line(f"2. sparse tok/s ≥ dense at L ≥ 4B (speedups {span(r['speedup'] for r in long)})", faster),
             goal_line(f"3. sparse ≥ 1.5× dense at L = 4096 (speedups {span(r['speedup'] for r in at4096)})", x15),
             goal_line(f"4. compression ≤ 10% of rollout time (max {summary['compress_share_le_10pct']['max_share']:.1%})"
                       if sparse else "4. compression ≤ 10% of rollout time", share),
             goal_line(f"5. dense tok/s ≥ HF generate (ratios {span(r['vs_hf'] for r in dense)})", hf)]
    lines += block_lines(rows, summary)
    return "\n".join(lines), summary


def block_lines(rows: list[dict], summary: dict) -> list[str]:
    """Per block configuration: its speedups over dense and over eviction (rkv) at the same B, and the
    first L from which it is at least as fast as dense at every longer L measured."""
    lines = []
    for config in sorted({r["config"] for r in rows if r["policy"] == "block"}):
        block = sorted((r for r in rows if r["config"] == config), key=lambda r: (r["model"], r["length"]))
        rkv = {(r["model"], r["length"]): r for r in rows if r["config"] == "rkv"}
        pays = next((r["length"] for i, r in enumerate(block) if all(b["speedup"] >= 1.0 for b in block[i:])), None)
        summary[f"{config}_pays_from"] = pays
        versus = [f"L={r['length']} {r['speedup']:.2f}x"
                  + (f" ({r['tokens_per_s'] / rkv[(r['model'], r['length'])]['tokens_per_s']:.2f}x rkv)"
                     if (r["model"], r["length"]) in rkv else "") for r in block]
        lines.append(f"- {config} vs dense (vs rkv at the same B): {', '.join(versus)}; "
                     + (f"as fast as dense from L = {pays} on" if pays else "never as fast as dense in this run"))
    return lines


def equal_batch(args, main_job: bool) -> dict:
    """Dense against every KV policy at equal batch: the warm-started built-in model, 8 prompts x 8 samples of the
    default pointer-walk task, per-row seeds, the config's window and interval. The stress regime (`main_job`
    False): B = 56, EOS off, so every row decodes the task's max_new_tokens. The main job's sampler (`main_job`
    True): the config's budget (80) with EOS on, so rows end where they end and leave the batch, as in training.
    One untimed run each, then `--repeats` rounds (dense, then each policy) back to back."""
    import statistics

    from sparserl.config.schema import load_config
    from sparserl.model.loading import load_policy
    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.dispatch.scheduler import request_seed
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression
    from sparserl.rollout.sparsity.policies import POLICIES
    from sparserl.tasks.registry import max_new_tokens, task_from_config

    config = load_config()
    model, tokenizer = load_policy(None)
    model.eval()
    task = task_from_config(config.task)
    steps = max_new_tokens(config.task, task)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples(8, seed=args.seed) for _ in range(8)]
    seeds = [request_seed(args.seed, i) for i in range(len(prompts))]
    eos = tokenizer.eos_token_id if main_job else None
    sampling = SamplingConfig(steps, config.rollout.temperature, eos, tokenizer.pad_token_id,
                              prompt_width=max(len(p) for p in prompts))
    budget = config.rollout.kv_budget if main_job else 56
    comp = KVCompression("rkv", budget=budget, window=config.rollout.kv_window, interval=config.rollout.kv_interval)
    engines = {"dense": RolloutEngine(model, record_evictions=False)}
    for policy in sorted(POLICIES, key=lambda name: name != "rkv"):
        engines[policy] = RolloutEngine(model, dataclasses.replace(comp, policy=policy), record_evictions=False)
    runs: dict[str, list] = {name: [] for name in engines}
    torch.set_num_threads(args.threads)
    for name, engine in engines.items():
        engine.generate(prompts, sampling, seeds=seeds)
    for _ in range(args.repeats):
        for name, engine in engines.items():
            gc.collect()
            batch = engine.generate(prompts, sampling, seeds=seeds)
            runs[name].append((batch.rollout_seconds, batch.kv.compress_seconds, int(batch.response_lengths.sum())))

    def figures(name):
        per_step = [t / steps * 1e3 for t, _, _ in runs[name]]
        ratios = [s[0] / d[0] for d, s in zip(runs["dense"], runs[name])]
        uncompressed = [(s[0] - s[1]) / d[0] for d, s in zip(runs["dense"], runs[name])]
        return {"seconds": statistics.median(t for t, _, _ in runs[name]),
                "ratio_without_compressions": statistics.median(uncompressed),
                "ms_per_step": (statistics.median(per_step), min(per_step), max(per_step)),
                "ratio": statistics.median(ratios), "ratio_spread": (min(ratios), max(ratios)),
                "tokens": statistics.median(n for _, _, n in runs[name]),
                "compress_share": statistics.median(c / t for t, c, _ in runs[name]),
                "compress_ms_per_step": statistics.median(c / steps * 1e3 for _, c, _ in runs[name])}

    return {"main_job": main_job, "steps": steps, "rows": len(prompts), "budget": comp.budget, "window": comp.window,
            "interval": comp.interval, "repeats": args.repeats, "modes": {name: figures(name) for name in runs}}


def equal_batch_text(r: dict) -> str:
    if r["main_job"]:
        head = (f"The main job's sampler at equal batch (warm-started built-in model, {r['rows']} rows = 8 "
                f"pointer-walk prompts x 8, EOS on, at most {r['steps']} decode steps, B = {r['budget']}")
    else:
        head = (f"Stress regime at equal batch (warm-started built-in model, {r['rows']} rows = 8 pointer-walk prompts "
                f"x 8, EOS off, {r['steps']} decode steps, B = {r['budget']}")
    lines = [head + f", w {r['window']}, Δ {r['interval']}; medians of {r['repeats']} interleaved rounds, min-max in "
             "brackets):", "",
             "| mode | rollout s | tokens | ms / decode step | / dense | / dense, compressions left out | "
             "compression ms / step | compression share |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        step = m["ms_per_step"]
        lines.append(f"| {name} | {m['seconds']:.3f} | {m['tokens']:.0f} | {step[0]:.2f} ({step[1]:.2f}-{step[2]:.2f}) "
                     f"| {m['ratio']:.3f} ({m['ratio_spread'][0]:.3f}-{m['ratio_spread'][1]:.3f}) | "
                     f"{m['ratio_without_compressions']:.3f} | {m['compress_ms_per_step']:.2f} | "
                     f"{m['compress_share']:.1%} |")
    rkv = r["modes"]["rkv"]
    goal, bound = ("sparse-rl's (R-KV) rollout ≤ dense's", 1.0) if r["main_job"] else \
        ("6. sparse (R-KV) / dense per decode step ≤ 1.05×", 1.05)
    lines.append(f"\n- {goal}: **{'MET' if rkv['ratio'] <= bound else 'NOT MET'}** ({rkv['ratio']:.3f}×)")
    return "\n".join(lines)


def profile(args, spec: str) -> str:
    from sparserl.rollout.sparsity.eviction import KVCompression

    model_name, length, policy = spec.split(":")
    length = int(length)
    model = build_model(model_name, args.seed)
    prompts = make_prompts(args.batch, model.config.vocab_size, args.seed + length)
    comp = KVCompression(policy, budget=length // 4, window=WINDOW, interval=compression_interval(length))
    run_ours(model, prompts, 192, KVCompression(policy, budget=64, window=WINDOW, interval=16), 0)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    r = run_ours(model, prompts, length, comp, args.seed)
    profiler.disable()
    buffer = io.StringIO()
    buffer.write(f"cProfile of one {policy} rollout, {model_name}, L={length}, B={length // 4}, "
                 f"Δ={comp.interval}: {r['rollout_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s, "
                 f"compression {r['compress_share']:.1%} ({r['compressions']} compressions)\n")
    stats = pstats.Stats(profiler, stream=buffer)
    buffer.write("by total time in the function itself:\n")
    stats.sort_stats("tottime").print_stats(args.profile_top)
    buffer.write("by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(args.profile_top)
    return buffer.getvalue()


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    import transformers

    started = time.perf_counter()
    results: dict = {"args": {k: v for k, v in vars(args).items()}, "load_avg_start": os.getloadavg(),
                     "probe_ms_start": contention_probe(args.threads),
                     "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    rows = [] if args.stress_only or args.main_job else bench(args)
    results["rows"] = rows
    if args.stress:
        results["stress"] = equal_batch(args, main_job=False)
    if args.main_job:
        results["main_job"] = equal_batch(args, main_job=True)
    results["probe_ms_end"] = contention_probe(args.threads)
    results["load_avg_end"] = os.getloadavg()
    results["wall_s"] = time.perf_counter() - started
    reduced = "30m" in args.model_list and (
        set(args.policy_lists["30m"]) != set(args.policy_lists["builtin"])
        or args.length_lists["30m"] != args.length_lists["builtin"] or not hf_enabled(args, "30m"))
    if rows:
        print(table(rows, args, reduced))
        print()
        text, results["goals"] = goals(rows)
        print(text)
    for part in ("stress", "main_job"):
        if part in results:
            print(("\n" if rows or part == "main_job" and args.stress else "") + equal_batch_text(results[part]))
    print(f"\nload average (1/5/15 min) at start {tuple(round(x, 2) for x in results['load_avg_start'])}, "
          f"at end {tuple(round(x, 2) for x in results['load_avg_end'])}; {os.cpu_count()} CPUs; "
          f"torch threads {args.threads}; wall {results['wall_s']:.0f} s")
    print(f"contention probe (one [64,128]x[128,384] linear, median ms; hundredths of a ms on a free core, "
          f"ms when the cores are shared): start {results['probe_ms_start']:.3f}, end {results['probe_ms_end']:.3f}")
    if args.profile:
        results["profile"] = profile(args, args.profile)
        print()
        print(results["profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
