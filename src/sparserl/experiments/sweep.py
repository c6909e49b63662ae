"""`sparserl sweep`: how a model fares under each KV budget, and which budgets are the two regimes.

For every budget of a grid it measures, on the same held-out prompts, greedy accuracy and exact
walks under sparse inference (against dense), the KV saved (1 − the sparse peak bytes / the dense greedy
rollouts' peak bytes on the same prompts), and, on
sampled rollouts scored by a dense recompute, what Sparse-RL's default filters reject (veto and
band rates) and the 1% quantile of ξ = π_old / π_sparse. It then names the two regimes of the
built-in experiment (README, "Regimes"):

- paper regime: the smallest budget whose sparse greedy accuracy is within `paper_gap` of dense
  and whose veto rate is at most `paper_veto`;
- stress regime: the largest budget that saves at least `stress_saved` of the peak KV bytes and
  loses at least `stress_gap` of greedy accuracy (the mildest such budget, so that sparse rollouts
  still earn reward).

Block-sparse attention keeps the whole cache and saves attention reads instead: for it, "saved"
is the share of cached keys a sparse layer does not read (1 − attended share).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..config.corrections import CorrectionConfig
from ..learner.corrections import compute_corrections
from ..model.forward import batched_logprobs
from ..rollout.batch import kv_saved
from ..rollout.dispatch.scheduler import RowLimits
from ..rollout.sparsity.eviction import KVCompression
from ..rollout.sparsity.settings import sparsity_from_config
from ..train.evaluation import accuracy, complete, evaluate_policy, task_rewards
from .eval import held_out


@dataclass(frozen=True)
class RegimeRule:
    paper_gap: float = 0.05
    paper_veto: float = 0.15
    stress_saved: float = 0.50
    stress_gap: float = 0.10


def sampled_mismatch(model, tokenizer, examples, max_new_tokens: int, compression: KVCompression,
                     samples: int, temperature: float, seed: int, micro_batch_size: int = 64,
                     limits: RowLimits = RowLimits()) -> dict[str, float]:
    """Veto and band rates of Sparse-RL's default filters, ξ's 1% quantile and sampled accuracy, on
    `samples` rollouts per example with the dense recompute as π_old."""
    done = complete(model, tokenizer, examples, max_new_tokens, temperature, compression, limits=limits,
                    samples=samples, seed=seed)
    vetoed = banded = alive = rows = 0.0
    quantiles = []
    for batch in done.batches:
        logp_old = batched_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1],
                                    micro_batch_size, temperature)
        result = compute_corrections(logp_old, batch.sampler_logprobs, batch.response_mask, CorrectionConfig())
        vetoed += result.metrics["rejected_sequences"]
        rows += len(batch)
        unvetoed = float((batch.response_mask * result.seq_keep[:, None]).sum())
        alive += unvetoed
        banded += unvetoed - float(result.keep_mask.sum())
        quantiles.append(result.metrics["xi_q01"])
    return {"veto_frac": vetoed / max(rows, 1), "band_frac": banded / max(alive, 1.0),
            "xi_q01": min(quantiles), "sampled_rollouts": int(rows), "_completions": done}


def run_sweep(config, budgets: list[int], n: int, samples: int, sample_prompts: int,
              rule: RegimeRule = RegimeRule()) -> dict:
    setup = held_out(config, n)
    model, tokenizer, task, examples, bound = (setup.model, setup.tokenizer, setup.task, setup.examples,
                                               setup.max_new_tokens)
    rewards = task_rewards(config, task)
    dense = evaluate_policy(model, tokenizer, task, examples, bound, None, 0, 1.0, config.train.seed, rewards=rewards,
                            limits=setup.limits)
    rows = []
    for budget in tqdm(budgets, desc="sweep", unit="budget"):
        compression = sparsity_from_config(dataclasses.replace(config.rollout, kv_budget=budget))
        sparse = evaluate_policy(model, tokenizer, task, examples, bound, compression, 0, 1.0, config.train.seed,
                                 rewards=rewards, limits=setup.limits)
        mismatch = sampled_mismatch(model, tokenizer, examples[:sample_prompts], bound, compression, samples,
                                    config.rollout.temperature, config.train.seed, limits=setup.limits)
        sampled = mismatch.pop("_completions")
        hits = rewards.score_examples(examples[:sample_prompts], sampled.texts, sampled.ids, samples)
        kv = sparse["kv"]
        saved = kv_saved(kv["kv_peak_bytes"], dense["kv"]["kv_peak_bytes"])
        rows.append({"budget": budget, "accuracy_sparse": sparse["accuracy"],
                     "walk_exact_sparse": sparse.get("walk_exact"), "gap": dense["accuracy"] - sparse["accuracy"],
                     "kv_saved": saved, "kv_kept_frac": kv["kv_kept_frac"], "kv_attended_frac": kv["kv_attended_frac"],
                     "saved_frac": 1 - kv["kv_attended_frac"] if kv["sparsity"] == "block" else saved,
                     "kv_peak_bytes": kv["kv_peak_bytes"], "rows_in_flight": kv["rows_in_flight"],
                     "sampled_accuracy_sparse": accuracy(hits), **mismatch})
    settings = {key: value for key, value in kv.items() if key in ("sparsity", "policy", "window", "interval",
                                                                   "page_size", "dense_layers")}
    return {"model": config.model.model or "built-in", "task": task.name, "examples": n, "sparsity": settings,
            "dense": {"accuracy": dense["accuracy"], "walk_exact": dense.get("walk_exact"),
                      "kv_peak_bytes": dense["kv"]["kv_peak_bytes"], "rows_in_flight": dense["kv"]["rows_in_flight"]},
            "rows": rows, "rule": dataclasses.asdict(rule), **choose_regimes(rows, rule)}


def choose_regimes(rows: list[dict], rule: RegimeRule) -> dict[str, int | None]:
    """The paper and stress budgets of `rows` (each with budget, gap, veto_frac and saved_frac: the
    share of peak KV bytes saved, or of attention reads for block-sparse attention)."""
    paper = [r["budget"] for r in rows if r["gap"] <= rule.paper_gap and r["veto_frac"] <= rule.paper_veto]
    stress = [r["budget"] for r in rows if r["saved_frac"] >= rule.stress_saved and r["gap"] >= rule.stress_gap]
    return {"paper_regime_budget": min(paper) if paper else None,
            "stress_regime_budget": max(stress) if stress else None}


def sweep_table(result: dict) -> str:
    """The sweep as a Markdown table, with the regimes marked."""
    sparsity = result["sparsity"]
    block = sparsity["sparsity"] == "block"
    # Block-sparse attention keeps every token: its figure is the share of cached keys it reads.
    memory = "attended share" if block else "KV saved (peak vs dense) | KV tokens kept"
    header = (f"| budget | sparse greedy acc | exact walks | dense − sparse | veto rate | band rate | ξ q01 "
              f"| {memory} | regime |\n|" + "---|" * (10 - block))
    lines = [header]
    for r in result["rows"]:
        mark = {result["paper_regime_budget"]: "paper", result["stress_regime_budget"]: "stress"}.get(r["budget"], "")
        exact = "—" if r["walk_exact_sparse"] is None else f"{100 * r['walk_exact_sparse']:.1f}%"
        figures = f"{r['kv_attended_frac']:.2f}" if block else f"{r['kv_saved']:.0%} | {r['kv_kept_frac']:.2f}"
        lines.append(f"| {r['budget']} | {100 * r['accuracy_sparse']:.1f}% | {exact} | {100 * r['gap']:+.1f} "
                     f"| {r['veto_frac']:.3f} | {r['band_frac']:.3f} | {r['xi_q01']:.2g} | {figures} | {mark} |")
    d = result["dense"]
    exact = "" if d["walk_exact"] is None else f", exact walks {100 * d['walk_exact']:.1f}%"
    exact += f"; peak KV {d['kv_peak_bytes'] / 2**20:.2f} MiB with {d['rows_in_flight']} rows at once"
    described = (f"block-sparse attention, pages of {sparsity['page_size']}, the first {sparsity['dense_layers']} "
                 "layer(s) dense" if block else
                 f"policy {sparsity['policy']}, window {sparsity['window']}, interval {sparsity['interval']}")
    return (f"Dense greedy accuracy {100 * d['accuracy']:.1f}%{exact} on {result['examples']} held-out prompts; "
            f"{described}.\n\n"
            + "\n".join(lines) + f"\n\nPaper regime: {_named(result['paper_regime_budget'])}; stress regime: "
            f"{_named(result['stress_regime_budget'])} (rules: {json.dumps(result['rule'])}).")


def _named(budget: int | None) -> str:
    return "no budget of the grid meets its rule" if budget is None else f"B = {budget}"


def write_sweep(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(sweep_table(result) + "\n")
