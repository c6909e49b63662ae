"""Graphs a whole training run captures, counted on a CPU: the main job run through `auto`'s GPU path (the decode
step captured per shape, graphs kept across rollouts in the runner's arena), with a stand-in capture that takes the
warm-up step and then runs each replayed step eagerly, so that every count is the runner's own bookkeeping.

For each mode: the rollouts, the step calls, the distinct (step, key, tensor addresses and shapes) the run met, the
captures it made with graphs kept across rollouts, and what it would have made with every graph dropped at the end
of its rollout (the sum over rollouts of the shapes each met: the runner before 2026-11-29). Also the graphs kept at
the end, the arena's memory, and the distinct (rows, capacity) pairs met.

    OMP_NUM_THREADS=1 python bench/captures.py --modes dense,sparse-rl --steps 80 --threads 1 --out runs/captures
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparserl import cli
from sparserl.rollout.engine import step


def _set(attributes: dict) -> None:
    for (owner, name), value in attributes.items():
        setattr(owner, name, value)


def run_mode(mode: str, steps: int, threads: int, out: Path) -> dict:
    rollouts: list[set] = []
    shapes: set = set()
    calls, captured = [0], [0]
    current: list = []  # the step and arguments of the call being replayed
    replay, one_rollout = step.StepRunner._replay, step.StepRunner.one_rollout

    def counted_replay(self, run, args, buffers, state, key):
        tensors = [t for t in (*buffers, *state) if t is not None]
        rollouts[-1].add((run, key, tuple((t.data_ptr(), tuple(t.shape)) for t in tensors), self._weights))
        cache = args[1] if run is step.decode_step else None
        if cache is not None:
            shapes.add((len(args[3].tokens), cache.layers[0].capacity))
        calls[0] += 1
        current[:] = [run, args]
        return replay(self, run, args, buffers, state, key)

    def counted_rollout(self, *models):
        rollouts.append(set())
        return one_rollout(self, *models)

    def capture(run, state):
        captured[0] += 1
        saved = [t.clone() for t in state]
        run()  # the warm-up a capture takes, undone as `_capture` undoes it
        for tensor, copy in zip(state, saved):
            tensor.copy_(copy)
        # A kept graph replays in a later rollout, whose Python objects are new: a CUDA graph reads the same addresses
        # (tests/test_kept_graphs.py replays by address); here the call's own step and arguments stand in for them.
        return type("Replayed", (), {"replay": staticmethod(lambda: current[0](*current[1]))})

    _set({(step.StepRunner, "_replay"): counted_replay, (step.StepRunner, "one_rollout"): counted_rollout,
               (step, "_capture"): capture,
               (step.StepRunner, "mode_for"): staticmethod(lambda compile_decode, device: "graphs")})
    try:
        cli.main(["train", "--mode", mode, "--steps", str(steps), "--seed", "0", "--threads", str(threads),
                  "--log-with", "none", "--out", str(out / mode)])
    finally:
        _set({(step.StepRunner, "_replay"): replay, (step.StepRunner, "one_rollout"): one_rollout})
    records = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in records if "step_captures" in r]
    met = set().union(*rollouts)
    return {"mode": mode, "rollouts": len(rollouts), "step_calls": calls[0], "distinct": len(met),
            "captures_kept": captured[0], "captures_in_metrics": sum(r["step_captures"] for r in trained),
            "captures_per_rollout": sum(len(r) for r in rollouts),
            "kept_at_end": max((r.get("step_graphs_kept", 0) for r in trained), default=0),
            "arena_mb": max((r.get("step_arena_bytes", 0) for r in trained), default=0) / 2**20,
            "rows_capacities": len(shapes), "rows": len({r for r, _ in shapes}),
            "capacities": len({c for _, c in shapes})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="dense,sparse-rl")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/captures"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [run_mode(mode, args.steps, args.threads, args.out) for mode in args.modes.split(",")]
    (args.out / "captures.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| mode | rollouts | step calls | distinct keys | captures, graphs kept | captures, dropped per rollout | "
          "kept at end | arena MiB | (rows, capacity) pairs: rows, capacities |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['rollouts']} | {r['step_calls']} | {r['distinct']} | {r['captures_kept']} | "
              f"{r['captures_per_rollout']} | {r['kept_at_end']} | {r['arena_mb']:.1f} | "
              f"{r['rows_capacities']}: {r['rows']}, {r['capacities']} |")


if __name__ == "__main__":
    main()
