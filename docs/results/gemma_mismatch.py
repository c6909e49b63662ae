"""The real-model mismatch study: Gemma-3-270M sampling reasoning-gym prompts with R-KV at three
budgets; ξ and α distributions, the α tail per cached-length bin and the reference veto rate.

Usage (after `sparserl model gemma-3-270m --out models/gemma-3-270m`):
    OMP_NUM_THREADS=1 python docs/results/gemma_mismatch.py models/gemma-3-270m docs/results/gemma
Writes study.json, study.md and study.png into the output directory.
"""

import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from sparserl.config.corrections import CorrectionConfig  # noqa: E402
from sparserl.config.schema import TaskConfig  # noqa: E402
from sparserl.learner.alpha import rollout_alpha_metrics  # noqa: E402
from sparserl.learner.corrections import compute_corrections  # noqa: E402
from sparserl.model.forward import batched_logprobs  # noqa: E402
from sparserl.model.loading import load_policy, sampling_generator  # noqa: E402
from sparserl.rollout.acceptance import bin_tails  # noqa: E402
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression  # noqa: E402
from sparserl.tasks.registry import task_from_config  # noqa: E402

PROMPTS, SAMPLES, RESPONSE, BIN = 8, 2, 256, 32
BUDGETS = (64, 128, 192)

torch.set_num_threads(1)
model_dir, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
model, tokenizer = load_policy(model_dir)
model.eval()
task = task_from_config(TaskConfig(task="reasoning_gym", gym_dataset="chain_sum"))
prompts = [tokenizer(e.prompt).input_ids for e in task.examples(PROMPTS, seed=0, split="train") for _ in range(SAMPLES)]
sampling = SamplingConfig(max_new_tokens=RESPONSE, temperature=1.0, eos_token_id=None,
                          pad_token_id=tokenizer.pad_token_id)
rows, xi_samples = [], {}
for budget in BUDGETS:
    compression = KVCompression("rkv", budget=budget, window=8, interval=16)
    started = time.perf_counter()
    batch = RolloutEngine(model, compression, record_evictions=False, record_distributions=True).generate(
        prompts, sampling, sampling_generator(model, 0))
    rollout_s = time.perf_counter() - started
    logp_old = batched_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1], 4)
    reference = compute_corrections(logp_old, batch.sampler_logprobs, batch.response_mask, CorrectionConfig.sparse_rl())
    alpha = rollout_alpha_metrics(model, [batch], 1.0, BIN, micro_batch_size=4)
    log_xi = (logp_old - batch.sampler_logprobs)[batch.response_mask.bool()]
    xi_samples[budget] = log_xi.tolist()
    m = reference.metrics
    rows.append({"budget": budget, "kv_peak_frac": batch.kv.kv_peak_bytes / batch.kv.kv_dense_bytes,
                 "rollout_s": rollout_s, "veto_frac": m["rejected_seq_frac"], "band_frac": m["band_mask_frac"],
                 **{k: m[k] for k in ("xi_q01", "xi_q05", "xi_q50", "xi_q95", "xi_q99", "xi_min", "kl_sampler_old")},
                 "alpha_mean": alpha["alpha_mean"], "alpha_tail": alpha.get("alpha_tail"),
                 "alpha_tail_by_bin": bin_tails(alpha),
                 "prompt_tokens_mean": float(batch.prompt_lengths.float().mean())})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "alpha_tail_by_bin"}), flush=True)

(out / "study.json").write_text(json.dumps({"model": model_dir, "prompts": PROMPTS, "samples": SAMPLES,
                                            "response_tokens": RESPONSE, "bin": BIN, "rows": rows}, indent=2))
lines = ["| budget | peak KV / dense | veto (seq.) | band (tokens) | ξ q01 | ξ q05 | ξ q50 | ξ min | KL(sparse‖dense) "
         "| α mean | α tail (worst bin) | rollout s |", "|" + "---|" * 12]
for r in rows:
    lines.append(f"| {r['budget']} | {r['kv_peak_frac']:.2f} | {r['veto_frac']:.1%} | {r['band_frac']:.1%} | "
                 f"{r['xi_q01']:.3g} | {r['xi_q05']:.3g} | {r['xi_q50']:.3f} | {r['xi_min']:.2g} | "
                 f"{r['kl_sampler_old']:.3f} | {r['alpha_mean']:.3f} | {r['alpha_tail']:.3f} | {r['rollout_s']:.0f} |")
starts = sorted({s for r in rows for s in r["alpha_tail_by_bin"]})
lines += ["", "α tail (5th percentile) per cached-length bin of 32 tokens:", "",
          "| budget | " + " | ".join(f"{s}+" for s in starts) + " |", "|" + "---|" * (len(starts) + 1)]
for r in rows:
    lines.append(f"| {r['budget']} | " + " | ".join(f"{r['alpha_tail_by_bin'].get(s, float('nan')):.3f}"
                                                 for s in starts) + " |")
(out / "study.md").write_text("\n".join(lines) + "\n")

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for r in rows:
    tails = r["alpha_tail_by_bin"]
    left.plot(sorted(tails), [tails[s] for s in sorted(tails)], marker="o", ms=3, label=f"B = {r['budget']}")
    values = sorted(xi_samples[r["budget"]])
    right.plot(values, [i / len(values) for i in range(len(values))], label=f"B = {r['budget']}")
left.set(title="α tail (5th pct.) by cached length", xlabel="cached length (bin start)", ylabel="α tail")
right.set(title="CDF of log ξ over response tokens", xlabel="log ξ = log π_dense − log π_sparse", ylabel="fraction",
          xlim=(-6, 3))
for ax in (left, right):
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out / "study.png", dpi=100)
print("\n".join(lines))
