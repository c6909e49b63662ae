"""The H200 decode tables of docs/benchmarks.md from the records in this folder.

    python docs/results/gpu_h200/table.py              # "On a GPU": runs 1-3 (2026-11-27)
    python docs/results/gpu_h200/table.py --compiled   # "Compiled, then captured": runs 4-5 (2026-11-28)

run 1: the first run of the static step on CUDA (compressions scored all layers at once: out of memory past 64 rows);
run 2: scored in stacks of at most 2 GiB of float32 keys, GPU kernels counted; run 3: the buffers also shrink to
B + Δ + 1 after a compression. Each ratio is to dense in the same run. Runs 4 and 5 (one machine each) time the
step captured as is (`--compile-decode auto`) and compiled then captured (`true`), each cell after one untimed
rollout; run 4 wrote the cache with `scatter_`, run 5 with `index_put_`.
"""

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {name: [json.loads(line) for line in (HERE / f"decode_{name}.jsonl").open()] for name in ("run1", "run2", "run3")}
COMPILED_RUNS = ("run4_graphs", "run4_compiled", "run5_graphs", "run5_compiled")


def cells(records) -> dict:
    """(L, rows, method) -> the cell's record, or {"error": ...} for a cell that failed."""
    found = {}
    for record in records:
        if record["what"] in ("cell", "equal-memory"):
            found[(record["L"], record["rows"], record["method"])] = record
        elif record["what"] == "error":
            cell = re.match(r"^(\S+) (\d+)x(\d+)$", record["which"])
            key = (int(cell[2]), int(cell[3]), cell[1]) if cell else \
                (4096, 2048, "rkv") if record["which"] == "equal memory" else None
            if key:
                found[key] = {"error": record["error"].split("(")[0]}
    return found


def shown(record, dense):
    if record is None:
        return "—"
    if "error" in record:
        return "out of memory" if "OutOfMemory" in record["error"] else record["error"]
    ratio = f", {record['tok_s'] / dense['tok_s']:.2f}x" if dense and "tok_s" in dense else ""
    kernels = f", {record['gpu_kernels_per_step']:.0f} k / {record['gpu_kernel_ms_per_step']:.1f} ms" \
        if "gpu_kernels_per_step" in record else ""
    return f"{record['step_ms']:.1f}{ratio}{kernels}"


def main() -> None:
    found = {name: cells(records) for name, records in RUNS.items()}
    order = ("dense", "rkv", "snapkv", "block", "spec-window", "spec-block", "hf-generate")
    keys = sorted({k for f in found.values() for k in f}, key=lambda k: (k[1] == 2048, k[0], k[1], order.index(k[2])))
    print("| L × rows | method | floor ms | run 1: step ms, × dense | run 2 | run 3 |")
    print("|---|---|---|---|---|---|")
    for length, rows, method in keys:
        dense_rows = 512 if rows == 2048 else rows
        parts = [shown(f.get((length, rows, method)), f.get((length, dense_rows, "dense"))) for f in found.values()]
        floor = next((f[(length, rows, method)].get("floor_step_ms") for f in found.values()
                      if f.get((length, rows, method)) and "floor_step_ms" in f[(length, rows, method)]), None)
        label = f"{length} × {rows}" + (" (equal memory)" if rows == 2048 else "")
        print(f"| {label} | {method} | {floor:.2f} | " if floor else f"| {label} | {method} | — | ", end="")
        print(" | ".join(parts) + " |")
    for name, records in RUNS.items():
        for record in records:
            if record["what"] == "xi-baseline":
                q = record["quantiles_0.001_0.01_0.5_0.99_0.999"]
                print(f"\n{name}, ξ dense sampler vs learner, {record['dtype']}: {record['outside_0.99_1.01']:.1%} of "
                      f"{record['tokens']} tokens outside [0.99, 1.01], {record['outside_0.9_1.1']:.1%} outside "
                      f"[0.9, 1.1]; q0.001 {q[0]:.4f}, q0.999 {q[4]:.4f}")


def compiled_table() -> None:
    found = {name: cells(json.loads(line) for line in (HERE / f"decode_{name}.jsonl").open())
             for name in COMPILED_RUNS}
    print("| L × rows | method | floor ms | run 4 (scatter_) captured: step ms, × dense, kernels / kernel ms | "
          "run 4 compiled, captured | run 5 (index_put_) captured | run 5 compiled, captured |")
    print("|---|---|---|---|---|---|---|")
    for length, rows, method in sorted({k for f in found.values() for k in f}):
        floor = next(f[(length, rows, method)]["floor_step_ms"] for f in found.values()
                     if "floor_step_ms" in f.get((length, rows, method), {}))
        parts = [shown(f.get((length, rows, method)), f.get((length, rows, "dense"))) for f in found.values()]
        print(f"| {length} × {rows} | {method} | {floor:.2f} | " + " | ".join(parts) + " |")


if __name__ == "__main__":
    compiled_table() if "--compiled" in sys.argv[1:] else main()
