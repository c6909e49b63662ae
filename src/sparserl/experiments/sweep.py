"""`sparserl sweep`: how a model fares under each KV budget and KV storage, and which budgets are the two regimes.

For every budget of a grid, and every KV storage of `--kv-dtypes` (auto: the model's dtype; fp8 or int8: a quantized
cache, also tried without eviction), it measures, on the same held-out prompts, greedy accuracy and exact
walks under sparse inference (against dense), the KV saved (1 − the sparse peak bytes / the dense greedy
rollouts' peak bytes on the same prompts, the dense cache in the model's dtype: a quantized cache's saving counts),
the α tail of the greedy rollouts, and, on sampled rollouts scored by a dense recompute, what Sparse-RL's default
filters reject (veto and band rates) and the 1% quantile of ξ = π_old / π_sparse. The same sampled figures of the
dense sampler are the numerics baseline: what ξ looks like when nothing but float rounding (the incremental decode
against the teacher-forced recompute, in the model's dtype) separates sampler and learner. It then names the two
regimes of the built-in experiment (README, "Regimes"), per KV storage:

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
from ..rollout.sparsity.settings import budgeted_sparsity, sparsity_from_config
from ..train.evaluation import accuracy, complete, evaluate_policy, task_rewards
from .eval import held_out


@dataclass(frozen=True)
class RegimeRule:
    paper_gap: float = 0.05
    paper_veto: float = 0.15
    stress_saved: float = 0.50
    stress_gap: float = 0.10


def sampled_mismatch(model, tokenizer, examples, max_new_tokens: int, compression: KVCompression | None,
                     samples: int, temperature: float, seed: int, micro_batch_size: int = 64,
                     limits: RowLimits = RowLimits(), kv_dtype: str = "auto") -> dict[str, float]:
    """Veto and band rates of Sparse-RL's default filters and ξ's 1% quantile, on `samples` rollouts per example
    (through `compression` and a cache stored as `kv_dtype`; neither: the dense sampler) with the dense recompute as
    π_old."""
    done = complete(model, tokenizer, examples, max_new_tokens, temperature, compression, limits=limits,
                    samples=samples, seed=seed, kv_dtype=kv_dtype)
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
              rule: RegimeRule = RegimeRule(), kv_dtypes: tuple[str, ...] = ("auto",)) -> dict:
    """Rows per KV storage of `kv_dtypes` (a quantized one first without eviction, budget None), then per budget."""
    budgeted_sparsity(config.rollout, "sparserl sweep")  # before any model loads
    setup = held_out(config, n)
    model, tokenizer, task, examples, bound = (setup.model, setup.tokenizer, setup.task, setup.examples,
                                               setup.max_new_tokens)
    rewards = task_rewards(config, task)

    def sampled(compression, kv_dtype: str) -> dict:
        mismatch = sampled_mismatch(model, tokenizer, examples[:sample_prompts], bound, compression, samples,
                                    config.rollout.temperature, config.train.seed, limits=setup.limits,
                                    kv_dtype=kv_dtype)
        done = mismatch.pop("_completions")
        hits = rewards.score_examples(examples[:sample_prompts], done.texts, done.ids, samples)
        return {"sampled_accuracy_sparse": accuracy(hits), **mismatch}

    dense = evaluate_policy(model, tokenizer, task, examples, bound, None, 0, 1.0, config.train.seed, rewards=rewards,
                            limits=setup.limits)
    floor = sampled(None, "auto")  # the numerics baseline: the dense sampler against the dense recompute
    floor["sampled_accuracy"] = floor.pop("sampled_accuracy_sparse")
    grid = [(kv_dtype, budget) for kv_dtype in kv_dtypes
            for budget in ([None] if kv_dtype != "auto" else []) + list(budgets)]
    rows, settings = [], {}
    for kv_dtype, budget in tqdm(grid, desc="sweep", unit="setting"):
        compression = None if budget is None else \
            sparsity_from_config(dataclasses.replace(config.rollout, kv_budget=budget))
        sparse = evaluate_policy(model, tokenizer, task, examples, bound, compression, 0, 1.0, config.train.seed,
                                 rewards=rewards, limits=setup.limits, kv_dtype=kv_dtype)
        kv = sparse["kv"]
        if budget is not None:
            settings = {key: value for key, value in kv.items() if key in ("sparsity", "policy", "window", "interval",
                                                                           "page_size", "dense_layers")}
        saved = kv_saved(kv["kv_peak_bytes"], dense["kv"]["kv_peak_bytes"])
        rows.append({"budget": budget, "kv_dtype": kv_dtype, "accuracy_sparse": sparse["accuracy"],
                     "walk_exact_sparse": sparse.get("walk_exact"), "gap": dense["accuracy"] - sparse["accuracy"],
                     "kv_saved": saved, "kv_kept_frac": kv["kv_kept_frac"], "kv_attended_frac": kv["kv_attended_frac"],
                     "saved_frac": 1 - kv["kv_attended_frac"] if kv["sparsity"] == "block" else saved,
                     "kv_peak_bytes": kv["kv_peak_bytes"], "kv_slot_bytes": kv["kv_slot_bytes"],
                     "rows_in_flight": kv["rows_in_flight"], "alpha_tail": sparse.get("alpha_tail"),
                     **sampled(compression, kv_dtype)})
    regimes = {kv_dtype: choose_regimes([r for r in rows if r["kv_dtype"] == kv_dtype and r["budget"] is not None],
                                        rule) for kv_dtype in kv_dtypes}
    headline = regimes["auto"] if "auto" in regimes else regimes[kv_dtypes[0]]
    return {"model": config.model.model or "built-in", "model_dtype": config.model.dtype, "task": task.name,
            "examples": n, "sparsity": settings, "kv_dtypes": list(kv_dtypes),
            "dense": {"accuracy": dense["accuracy"], "walk_exact": dense.get("walk_exact"),
                      "kv_peak_bytes": dense["kv"]["kv_peak_bytes"], "kv_slot_bytes": dense["kv"]["kv_slot_bytes"],
                      "rows_in_flight": dense["kv"]["rows_in_flight"], **floor},
            "rows": rows, "rule": dataclasses.asdict(rule), "regimes": regimes, **headline}


def choose_regimes(rows: list[dict], rule: RegimeRule) -> dict[str, int | None]:
    """The paper and stress budgets of `rows` (each with budget, gap, veto_frac and saved_frac: the
    share of peak KV bytes saved, or of attention reads for block-sparse attention)."""
    paper = [r["budget"] for r in rows if r["gap"] <= rule.paper_gap and r["veto_frac"] <= rule.paper_veto]
    stress = [r["budget"] for r in rows if r["saved_frac"] >= rule.stress_saved and r["gap"] >= rule.stress_gap]
    return {"paper_regime_budget": min(paper) if paper else None,
            "stress_regime_budget": max(stress) if stress else None}


def sweep_table(result: dict) -> str:
    """The sweep as a Markdown table, with the regimes marked; its first row the dense sampler's own figures, the
    numerics baseline every row's veto, band and ξ compare with."""
    sparsity = result["sparsity"]
    block = sparsity["sparsity"] == "block"
    d = result["dense"]
    regimes = result.get("regimes") or {"auto": {key: result[key] for key in ("paper_regime_budget",
                                                                                "stress_regime_budget")}}
    # Block-sparse attention keeps every token: its figure is the share of cached keys it reads.
    memory = "attended share" if block else "KV saved (peak vs dense, model dtype) | KV tokens kept"
    header = (f"| budget | KV storage | sparse greedy acc | exact walks | dense − sparse | α tail | veto rate "
              f"| band rate | ξ q01 | {memory} | regime |\n|" + "---|" * (12 - block))
    floor = "" if "xi_q01" not in d else (
        f"| dense (numerics baseline) | auto | {100 * d['accuracy']:.1f}% | {_percent(d['walk_exact'])} | +0.0 | — "
        f"| {d['veto_frac']:.3f} | {d['band_frac']:.3f} | {_xi(d['xi_q01'])} | "
        + ("1.00" if block else "0% | 1.00") + " | |")
    lines = [header] + ([floor] if floor else [])
    for r in result["rows"]:
        kv_dtype = r.get("kv_dtype", "auto")
        marks = {v: k.split("_")[0] for k, v in regimes.get(kv_dtype, {}).items() if v is not None}
        mark = marks.get(r["budget"], "") if r["budget"] is not None else ""
        figures = f"{r['kv_attended_frac']:.2f}" if block else f"{r['kv_saved']:.0%} | {r['kv_kept_frac']:.2f}"
        alpha = "—" if r.get("alpha_tail") is None else f"{r['alpha_tail']:.3g}"
        budget = "none (no eviction)" if r["budget"] is None else r["budget"]
        lines.append(f"| {budget} | {kv_dtype} | {100 * r['accuracy_sparse']:.1f}% | {_percent(r['walk_exact_sparse'])} "
                     f"| {100 * r['gap']:+.1f} | {alpha} | {r['veto_frac']:.3f} | {r['band_frac']:.3f} "
                     f"| {_xi(r['xi_q01'])} | {figures} | {mark} |")
    exact = "" if d["walk_exact"] is None else f", exact walks {100 * d['walk_exact']:.1f}%"
    exact += f"; peak KV {d['kv_peak_bytes'] / 2**20:.2f} MiB with {d['rows_in_flight']} rows at once"
    described = (f"block-sparse attention, pages of {sparsity['page_size']}, the first {sparsity['dense_layers']} "
                 "layer(s) dense" if block else
                 f"policy {sparsity['policy']}, window {sparsity['window']}, interval {sparsity['interval']}")
    dtype = result.get("model_dtype", "the model's dtype")
    baseline = ("" if not floor else
                f" The first row is the dense sampler against the dense recompute in {dtype}: ξ there is float "
                "rounding alone, the floor of every other row's ξ, veto and band.")
    headline = "auto" if "auto" in regimes else next(iter(regimes))
    others = "".join(f"; with kv_dtype {kv_dtype}, paper regime {_named(r['paper_regime_budget'])} and stress regime "
                     f"{_named(r['stress_regime_budget'])}" for kv_dtype, r in regimes.items() if kv_dtype != headline)
    first = "" if headline == "auto" else f" (kv_dtype {headline})"
    return (f"Dense greedy accuracy {100 * d['accuracy']:.1f}%{exact} on {result['examples']} held-out prompts "
            f"(model weights and dense cache in {dtype}); {described}. KV saved is against that dense cache's peak, "
            f"so a quantized cache's saving counts.{baseline}\n\n"
            + "\n".join(lines) + f"\n\nPaper regime{first}: {_named(result['paper_regime_budget'])}; stress regime: "
            f"{_named(result['stress_regime_budget'])}{others} (rules: {json.dumps(result['rule'])}).")


def _xi(value: float) -> str:
    """ξ's quantile, its distance from 1 written out when under 1% (float rounding is 1e-7 to 1e-3 off 1)."""
    if value != 1 and abs(1 - value) < 0.01:
        return f"1 {'−' if value < 1 else '+'} {abs(1 - value):.1e}"
    return f"{value:.3g}"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _named(budget: int | None) -> str:
    return "no budget of the grid meets its rule" if budget is None else f"B = {budget}"


def write_sweep(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(sweep_table(result) + "\n")
