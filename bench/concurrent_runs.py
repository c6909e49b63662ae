"""Two training runs at once on a shared machine: how much does each slow the other?

    python bench/concurrent_runs.py [--steps 6] [--mode sparse-rl] [--json FILE]

For each thread setting (torch's default count with spinning or sleeping idle threads, and
`--threads auto`), one `sparserl train` runs alone, then two run side by side; the table gives the
median step time (the first step, which warms up, left out) and the slowdown pairing causes. Run it
on a machine with nothing else running: the point is what two of our own jobs do to each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {  # name: (--threads, OMP_WAIT_POLICY)
    "torch default threads, spinning waits": ("0", "ACTIVE"),
    "torch default threads, passive waits": ("0", "PASSIVE"),
    "--threads auto, passive waits (default)": ("auto", "PASSIVE"),
}


def _train(out: Path, threads: str, wait_policy: str, steps: int, mode: str, seed: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OMP_WAIT_POLICY"] = wait_policy
    command = [sys.executable, "-m", "sparserl.cli", "train", "--out", str(out), "--steps", str(steps),
               "--mode", mode, "--seed", str(seed), "--threads", threads, "--eval-every", "0",
               "--log-with", "none"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _median_step_s(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["step_s"] for r in records if r.get("step", 0) > 1 and "step_s" in r)


def _run(root: Path, jobs: int, threads: str, wait_policy: str, steps: int, mode: str) -> list[float]:
    outs = [root / f"job{i}" for i in range(jobs)]
    processes = [_train(out, threads, wait_policy, steps, mode, seed=i) for i, out in enumerate(outs)]
    for process in processes:
        _, err = process.communicate()
        if process.returncode:
            raise SystemExit(f"sparserl train failed:\n{err}")
    return [_median_step_s(out) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mode", default="sparse-rl")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    print(f"cores {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f} at start")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (threads, wait_policy) in SETTINGS.items():
            alone = _run(Path(tmp) / f"{threads}-{wait_policy}-alone", 1, threads, wait_policy, args.steps,
                         args.mode)[0]
            paired = _run(Path(tmp) / f"{threads}-{wait_policy}-paired", 2, threads, wait_policy, args.steps,
                          args.mode)
            rows.append({"setting": name, "alone_s": alone, "paired_s": paired,
                         "slowdown": max(paired) / alone})
    print(f"load {os.getloadavg()[0]:.2f} at end\n")
    print("| setting | step s, alone | step s, two at once | slowdown |")
    print("|---|---|---|---|")
    for row in rows:
        paired = " / ".join(f"{s:.2f}" for s in row["paired_s"])
        print(f"| {row['setting']} | {row['alone_s']:.2f} | {paired} | {row['slowdown']:.1f}× |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
