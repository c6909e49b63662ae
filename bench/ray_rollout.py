"""Training steps with rollouts in process (N = 0) and on N = 1, 2 Ray workers, in one run.

    python bench/ray_rollout.py --steps 4 --threads 1 [--mode sparse-rl] [--json FILE]

Each configuration trains the built-in model on the built-in task from the same weights and seed,
with the same shards (--shards, default 2: the data are identical across N, so only time differs),
for --warmup untimed steps (worker start-up, first weight load) and then --steps timed ones. The
table shows medians per step:

- step s, rollout s: wall time of the whole step and of its rollout (request to last shard back);
- tokens/s: response tokens per rollout second;
- push s: the driver's one `ray.put` of the weights per step; load s: the slowest worker's fetch and
  `load_state_dict`; transfer s: per shard, round trip minus the worker's own sampling and loading
  (the object transfer of requests and rollout batches, and Ray's scheduling);
- overhead: (push + load + transfer) / rollout.

It also times `ray.put` + a worker's `ray.get` of a --payload-mb state dict, the bandwidth a larger
model's weight push would see on this machine (what `docs/benchmarks.md` extrapolates from).
Every process uses --threads torch threads, so N = 2 uses 3 processes on a 2-core machine: the
driver idles while workers sample, but the numbers are still a lower bound of the speedup on
machines with a core (or a GPU) per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import ray
import torch
from common import contention_probe

from sparserl.config.schema import load_config
from sparserl.rollout.dispatch.ray_workers import (
    arrays_from_tensors,
    tensors_from_arrays,
)
from sparserl.train.trainer import GRPOTrainer

COLUMNS = ("step_s", "rollout_s", "tokens_per_s", "weight_push_s", "weight_load_s", "rollout_transfer_s")


def run(workers: int, args, out: str) -> dict[str, float]:
    config = load_config(None, {"mode": args.mode, "rollout_workers": workers, "rollout_shards": args.shards,
                                "threads": args.threads, "steps": args.warmup + args.steps, "eval_every": 0,
                                "checkpoint_every": 1000, "log_with": "none", "out": out, "seed": args.seed})
    trainer = GRPOTrainer(config)
    records = []
    try:
        for step in range(1, args.warmup + args.steps + 1):
            record = trainer.train_step(step)
            trainer.state.step = step
            if step > args.warmup:
                records.append(record)
    finally:
        trainer.rollouts.close()
        trainer.run.release(failed=False)
    row = {key: statistics.median(r.get(key, 0.0) for r in records) for key in COLUMNS}
    row["overhead"] = (row["weight_push_s"] + row["weight_load_s"] + row["rollout_transfer_s"]) / row["rollout_s"]
    row["weights_mb"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 2 ** 20
    return row


@ray.remote(num_cpus=1)
def _fetch(refs: list) -> float:
    started = time.perf_counter()
    tensors_from_arrays(ray.get(refs[0]))
    return time.perf_counter() - started


def payload_bandwidth(megabytes: int) -> tuple[float, float]:
    """Seconds of the weight push's `ray.put` of a state dict of that size, and of a worker's get of it
    (the same conversions as `RayRollouts.sync_weights` and `RolloutWorker.generate`, without the load)."""
    state = {f"layer{i}": torch.randn(megabytes * 2 ** 20 // 4 // 16) for i in range(16)}
    started = time.perf_counter()
    ref = ray.put(arrays_from_tensors(state))
    put = time.perf_counter() - started
    ray.get(_fetch.remote([ref]))  # a first call starts the worker process
    return put, ray.get(_fetch.remote([ref]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--mode", default="sparse-rl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--payload-mb", type=int, default=1024)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"contention probe {contention_probe(args.threads):.3f} ms, load {os.getloadavg()[0]:.2f}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (0, 1, 2):
            rows[workers] = run(workers, args, f"{tmp}/n{workers}")
    put, get = payload_bandwidth(args.payload_mb)
    ray.shutdown()
    print(f"\nmode {args.mode}, built-in model ({rows[0]['weights_mb']:.1f} MiB of weights), {args.shards} shards, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'N':>2} {'step s':>7} {'rollout s':>9} {'tokens/s':>9} {'push s':>7} {'load s':>7} {'transfer s':>10} "
          f"{'overhead':>8} {'speedup':>7}")
    for workers, row in rows.items():
        print(f"{workers:>2} {row['step_s']:7.2f} {row['rollout_s']:9.2f} {row['tokens_per_s']:9.0f} "
              f"{row['weight_push_s']:7.3f} {row['weight_load_s']:7.3f} {row['rollout_transfer_s']:10.3f} "
              f"{row['overhead']:8.1%} {rows[0]['rollout_s'] / row['rollout_s']:6.2f}x")
    print(f"\nweight push of {args.payload_mb} MiB: ray.put {put:.2f} s ({args.payload_mb / put:.0f} MiB/s), "
          f"a worker's ray.get {get:.2f} s ({args.payload_mb / get:.0f} MiB/s)")
    print(f"contention probe {contention_probe(args.threads):.3f} ms, load {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "payload_mb": args.payload_mb, "put_s": put, "get_s": get}, f, indent=1)


if __name__ == "__main__":
    main()
