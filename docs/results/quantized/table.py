"""The quantized-KV study's tables (docs/results/quantized.md), from the runs `run.sh` writes under runs/quantized/.

    python docs/results/quantized/table.py            # prints the tables; writes table.md and records.json here
    python docs/results/quantized/table.py --seeds 0  # only those seeds (finished or not)

Per cell (seeds found, partial runs marked; mean (min to max) over them): the regime at the start (step 0's greedy gap, dense − sparse inference of
the start model on the 200 held-out prompts; step 1's ξ 1% quantile, α tail and the share of rollouts the 1e-4 veto
flags), the peak KV bytes over training against the dense run's of the same seed (float32, as measured) and against a
bf16 dense cache (the same slots in a bf16 model's formats, computed from the measured bytes: auto halves, fp8 is
unchanged, int8's per-token value scales halve), and after training the held-out accuracy under dense and under
sparse inference, with per-seed paired differences: under dense inference against the
dense run, under sparse inference against the dense-trained model under the same sparse inference (`run.sh`'s
`dense_model_under/`; for R-KV 56 alone, the dense run's own sparse-inference figure). records.json keeps every
per-seed figure, so the table survives the runs' removal.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
RUNS = ROOT / "runs" / "quantized"
SEEDS = (0, 1, 2)
STEPS = 80
# cell: (compare mode, sampler, kv_dtype, how `run.sh` evaluates the dense model under it)
CELLS = {
    "dense": ("dense", "dense cache (float32)", "auto", None),
    "rkv56": ("geo-rs", "R-KV B = 56", "auto", "own"),
    "fp8": ("geo-rs", "fp8, no eviction", "fp8", "fp8"),
    "int8": ("geo-rs", "int8, no eviction", "int8", "int8"),
    "rkv56-fp8": ("geo-rs", "R-KV B = 56 + fp8", "fp8", "rkv56-fp8"),
    "nemo-fp8": ("nemo-fp8", "fp8, no eviction; token TIS at 2 (NeMo-RL)", "fp8", "fp8"),
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _model_shapes() -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the built-in model the study trains."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from sparserl.model.loading import load_policy

    model, _ = load_policy(None, torch.float32, torch.device("cpu"))
    config = model.config
    return (config.num_hidden_layers, config.num_key_value_heads,
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def bf16_bytes(peak: float, kv_dtype: str, rows: int, shapes: tuple[int, int, int]) -> float:
    """The bytes a bf16 model's cache of the same slots would hold, from a float32 model's measured `peak`: auto
    stores 2 bytes an element instead of 4; fp8 stores 1 byte either way, its scales float32 either way; int8's
    per-slot value scales are in the model's dtype (4 bytes a KV head, 2 in bf16), its per-row key scales float32."""
    layers, heads, dim = shapes
    if kv_dtype == "auto":
        return peak / 2
    if kv_dtype == "fp8":
        return peak
    fixed = rows * layers * heads * dim * 4
    per_slot = 2 * heads * dim + 4 * heads
    return peak - (peak - fixed) * (2 * heads) / per_slot


def run_figures(cell: str, seed: int, shapes) -> dict | None:
    mode, _, kv_dtype, under = CELLS[cell]
    run = RUNS / cell / mode / f"seed{seed}"
    records = _records(run / "metrics.jsonl")
    if not records:
        return None
    start = next((r for r in records if r["step"] == 0 and "eval_accuracy_dense" in r), None)
    steps = [r for r in records if r["step"] >= 1 and "kv_peak_bytes" in r]
    first = steps[0] if steps else {}
    final = json.loads((run / "final_eval.json").read_text()) if (run / "final_eval.json").exists() else None
    peak = max((r["kv_peak_bytes"] for r in steps), default=None)
    rows = max((r["rows_in_flight"] for r in steps), default=None)
    figures = {
        "cell": cell, "seed": seed, "steps": len(steps), "done": final is not None,
        "gap0": None if start is None else start["eval_accuracy_dense"] - start["eval_accuracy_sparse"],
        "acc0_dense": None if start is None else start["eval_accuracy_dense"],
        "acc0_sparse": None if start is None else start["eval_accuracy_sparse"],
        "xi_q01": first.get("xi_q01"), "alpha_tail": first.get("alpha_tail"),
        "veto": first.get("flagged_veto_frac"), "peak_train": peak, "rows": rows,
        "peak_train_bf16": None if peak is None else bf16_bytes(peak, kv_dtype, rows, shapes),
        "step_s": statistics.mean(r["step_s"] for r in steps) if steps else None,
        "final_dense": None if final is None else final["dense"]["accuracy"],
        "final_sparse": None if final is None else final["sparse"]["accuracy"],
        "eval_peak_sparse": None if final is None else final["sparse"]["kv"]["kv_peak_bytes"],
        "eval_peak_dense": None if final is None else final["dense"]["kv"]["kv_peak_bytes"],
    }
    # The dense-trained model of this seed under this cell's sparse inference: the baseline of its sparse figure.
    if under == "own":
        dense_final = RUNS / "dense" / "dense" / f"seed{seed}" / "final_eval.json"
        figures["dense_model_sparse"] = json.loads(dense_final.read_text())["sparse"]["accuracy"] \
            if dense_final.exists() else None
    elif under is not None:
        path = RUNS / "dense_model_under" / f"{under}.seed{seed}.json"
        figures["dense_model_sparse"] = json.loads(path.read_text())["sparse"]["accuracy"] if path.exists() else None
    return figures


def spread(values: list[float], form: str | None) -> str:
    """Mean (min–max) of the values found, in `form` (None: ξ's, its distance from 1 written out near 1)."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    show = xi if form is None else form.format
    mean = show(statistics.mean(values))
    if len(values) == 1 or min(values) == max(values):
        return mean
    return f"{mean} ({show(min(values))} to {show(max(values))})"


def xi(value: float) -> str:
    if value != 1 and abs(1 - value) < 0.01:
        return f"1 {'−' if value < 1 else '+'} {abs(1 - value):.1e}"
    return f"{value:.3g}"


def paired(values: list[tuple[float | None, float | None]]) -> str:
    """Per-seed differences a − b in points, and with two or more seeds their mean and 95% t-interval."""
    pairs = [(a, b) for a, b in values if a is not None and b is not None]
    if not pairs:
        return "—"
    differences = [100 * (a - b) for a, b in pairs]
    text = ", ".join(f"{d:+.1f}" for d in differences)
    if len(differences) >= 2:
        sys.path.insert(0, str(ROOT / "src"))
        from sparserl.report.statistics import paired_t

        found = paired_t(differences)
        text += f"; mean {found.estimate:+.1f} [{found.low:+.1f}, {found.high:+.1f}]"
    return text


def of_dense(values: list[tuple[float | None, float | None]]) -> str:
    """The cell's mean over dense's, and with two or more seeds its 95% interval: 1 + the paired difference's
    t-interval over dense's mean (docs/results.md's convention)."""
    pairs = [(a, b) for a, b in values if a is not None and b is not None]
    if not pairs:
        return "—"
    base = statistics.mean(b for _, b in pairs)
    text = f"{statistics.mean(a for a, _ in pairs) / base:.0%}"
    if len(pairs) >= 2:
        sys.path.insert(0, str(ROOT / "src"))
        from sparserl.report.statistics import paired_t

        found = paired_t([a - b for a, b in pairs])
        text += f" ({1 + found.low / base:.0%} to {1 + found.high / base:.0%})"
    return text


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default: 0,1,2)")
    seeds = [int(s) for s in parser.parse_args().seeds.split(",") if s.strip()]
    shapes = _model_shapes()
    found = {cell: [f for f in (run_figures(cell, s, shapes) for s in seeds) if f is not None] for cell in CELLS}
    dense = {f["seed"]: f for f in found["dense"]}
    lines = ["Regime at the start (per cell; mean (min to max) over the seeds found):", "",
             "| cell | sampler | seeds (done / started) | step-0 greedy gap, dense − sparse inf. (points) "
             "| step-1 ξ q01 | step-1 α tail | step-1 veto flagged | mean step s |",
             "|---|---|---|---|---|---|---|---|"]
    for cell, runs in found.items():
        mode, sampler, _, _ = CELLS[cell]
        done = sum(f["done"] for f in runs)
        sampler_gap = [0.0 if cell == "dense" else (None if f["gap0"] is None else 100 * f["gap0"]) for f in runs]
        lines.append(f"| {cell} ({mode}) | {sampler} | {done} / {len(runs)} | {spread(sampler_gap, '{:+.1f}')} "
                     f"| {spread([f['xi_q01'] for f in runs], None)} "
                     f"| {spread([f['alpha_tail'] for f in runs], '{:.3g}')} "
                     f"| {spread([f['veto'] for f in runs], '{:.1%}')} | {spread([f['step_s'] for f in runs], '{:.1f}')} |")
    lines += ["", "Peak KV bytes over training, against the dense run of the same seed:", "",
              "| cell | peak KV MiB (float32 model) | of dense's (float32 cache) | of a bf16 dense cache "
              "| greedy eval, sparse inf. of dense inf. (same run, 200 prompts) |", "|---|---|---|---|---|"]
    for cell, runs in found.items():
        of32 = [f["peak_train"] / dense[f["seed"]]["peak_train"] for f in runs
                if f["peak_train"] and f["seed"] in dense and dense[f["seed"]]["peak_train"]]
        of16 = [f["peak_train_bf16"] / dense[f["seed"]]["peak_train_bf16"] for f in runs
                if f["peak_train"] and f["seed"] in dense and dense[f["seed"]]["peak_train"]]
        evals = [f["eval_peak_sparse"] / f["eval_peak_dense"] for f in runs if f["eval_peak_sparse"]]
        lines.append(f"| {cell} | {spread([f['peak_train'] and f['peak_train'] / 2**20 for f in runs], '{:.2f}')} "
                     f"| {spread(of32, '{:.1%}')} | {spread(of16, '{:.1%}')} "
                     f"| {'—' if cell == 'dense' else spread(evals, '{:.1%}')} |")
    lines += ["", f"Held-out accuracy after {STEPS} steps (200 prompts, greedy), finished runs only:", "",
              "| cell | seeds | dense inf. | − dense run, per seed (points) | of dense (95% CI) | sparse inf. (its "
              "sampler) | − dense-trained model under the same sparse inf., per seed (points) |",
              "|---|---|---|---|---|---|---|"]
    for cell, runs in found.items():
        done = [f for f in runs if f["done"]]
        if not done:
            lines.append(f"| {cell} | 0 | not yet | | | | |")
            continue
        vs_dense = [(f["final_dense"], dense[f["seed"]]["final_dense"] if f["seed"] in dense else None)
                    for f in done]
        vs_sparse = [(f["final_sparse"], f.get("dense_model_sparse")) for f in done]
        sparse_cell = spread([f["final_sparse"] for f in done], "{:.1%}")
        lines.append(f"| {cell} | {', '.join(str(f['seed']) for f in done)} "
                     f"| {spread([f['final_dense'] for f in done], '{:.1%}')} "
                     f"| {'—' if cell == 'dense' else paired(vs_dense)} "
                     f"| {'—' if cell == 'dense' else of_dense(vs_dense)} | {sparse_cell} | {'—' if cell == 'dense' else paired(vs_sparse)} |")
    under = [f"{f['cell']} seed {f['seed']}: {f['dense_model_sparse']:.1%}" for runs in found.values() for f in runs
             if f.get("dense_model_sparse") is not None and f["cell"] not in ("rkv56", "nemo-fp8")]
    if under:
        lines += ["", "The dense-trained model under each quantized sparse inference: " + "; ".join(under) + "."]
    text = "\n".join(lines)
    print(text)
    (HERE / "table.md").write_text(text + "\n")
    (HERE / "records.json").write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
