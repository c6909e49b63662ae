"""The kill-anywhere soak: training killed with SIGKILL at any moment resumes to the same run, and its
memory stays flat over a long one.

    python bench/soak.py kill   [--kills 20] [--steps 24] [--seed 0] [--work DIR] [--json FILE]
    python bench/soak.py ray    [--steps 6] [--work DIR] [--json FILE]
    python bench/soak.py memory [--steps 500] [--eval-every 10] [--work DIR] [--json FILE]

`kill`: the built-in experiment (`sparserl train --mode sparse-rl --threads 1`, a checkpoint every
step, evaluation every 4) runs once uninterrupted, then again, SIGKILLed `--kills` times and resumed
with `--resume` after each. Both score with a second reward function, `pause` (below, weight 0: it
sleeps and scores 0, which adds exactly 0 to every reward), so that a reward call lasts long enough
to land in. The kills are aimed at phases, five each in a shuffled order, at random offsets:
- rollout: a step's rollout starts when the previous step's checkpoint appears; the kill comes a
  random fraction of the previous step's `rollout_s` later (as this process logged it: the machine's
  load changes step times twofold, so the uninterrupted run's times are no guide);
- reward: while a reward worker (a child of the trainer with its command line) is alive;
- checkpoint: while the checkpoint's temporary directory (`.tmp_step_N`) exists, a random fraction
  of its lifetime on the uninterrupted run after it appears;
- update: the `pause` worker's exit ends scoring; the kill comes the previous step's `recompute_s`
  plus a random fraction of its `update_s` later.
Each kill records what was seen at that moment (a live reward worker, the temporary directory, the
step's metrics line), so that the table says where it landed. After each kill: no process of the
killed trainer's tree is left (this process is the child subreaper, so any orphan becomes its child
and is seen), and the run directory's lock is free. At the end every step's metrics (all keys but
wall-clock timings) and the final checkpoint's `model.safetensors` (byte for byte) must equal the
uninterrupted run's.

`ray`: the same with `--rollout-workers 2 --rollout-shards 2`: a rollout worker (a `ray::RolloutWorker`
process in the trainer's tree) is killed while it samples, at two steps, and must be replaced; then
the trainer itself, while a worker samples. The run is resumed at once and must end as an
uninterrupted Ray run does (`rollout_retries` aside); the killed trainer's processes are followed
until all have gone. (Ray's own DashboardAgent and RuntimeEnvAgent take about 60 s: they see the
raylet die at once, then report it to the dead GCS with a 60 s timeout before they exit.)

`memory`: a `--steps` run of the built-in experiment (sparse-rl, default settings, `--threads 1`)
whose trainer RSS must stay within 5% of its value from step 50 (see `run_memory_soak`).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

PAUSE_S = 0.6  # how long the `pause` reward sleeps: a reward call to land in
POLL_S = 0.005  # a /proc scan takes 1.5 ms
TIMING_KEYS = ("_s", "_seconds", "per_s", "time_frac")  # wall-clock metrics: they differ from run to run
PHASES = ("rollout", "reward", "checkpoint", "update")


def pause(completions, **_) -> list[float]:
    """A reward function (weight 0 in the soak) that takes PAUSE_S and scores 0."""
    time.sleep(PAUSE_S)
    return [0.0] * len(completions)


# ---------------------------------------------------------------------------- processes
def process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process, from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(b")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(pid: int) -> list[int]:
    table = process_table()
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, (ppid, _) in table.items() if ppid == parent]
        found += children
        frontier += children
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def become_subreaper() -> None:
    """Orphans of the trainers this process starts become its children instead of init's: seen, and reaped here."""
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def leftovers(tree: list[int], limit_s: float, ours: tuple[int, ...] = ()) -> tuple[float, list[str]]:
    """Seconds until no process of `tree` (a killed trainer's, listed at the kill) and no orphan
    re-parented to this process (`ours` aside) is alive, reaping the dead; and the last ones to go.
    Those still alive at `limit_s` are killed, and named with "left:"."""
    began, last = time.time(), []
    while True:
        table = process_table()
        for pid, (ppid, state) in table.items():
            if ppid == os.getpid() and state == "Z" and pid not in ours:
                os.waitpid(pid, os.WNOHANG)
        live = [p for p, (ppid, state) in table.items()
                if state != "Z" and p not in ours and (p in tree or ppid == os.getpid())]
        if not live:
            return round(time.time() - began, 1), last
        last = [f"{p} {command_line(p)[:40]}" for p in live]
        if time.time() - began > limit_s:
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            return round(time.time() - began, 1), [f"left: {name}" for name in last]
        time.sleep(0.05)


def lock_is_free(out: Path) -> bool:
    with open(out / ".lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
    return True


# ---------------------------------------------------------------------------- runs
def train_command(out: Path, steps: int, eval_every: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparserl.cli", "train", "--mode", "sparse-rl", "--threads", "1",
            "--out", str(out), "--steps", str(steps), "--checkpoint-every", "1", "--eval-every", str(eval_every),
            "--log-with", "none", "--reward-funcs", f"task,{Path(__file__).resolve()}:pause",
            "--reward-weights", "1,0", *extra]


def start(command: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checkpoint_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    names = os.listdir(root) if root.is_dir() else []
    return sorted(int(n[len("step_"):]) for n in names if n.startswith("step_"))


def weights_digest(out: Path, step: int) -> str:
    return hashlib.sha256((out / f"checkpoints/step_{step:06d}/policy/model.safetensors").read_bytes()).hexdigest()


def differences(reference: list[dict], run: list[dict], ignored: tuple[str, ...] = ()) -> list[str]:
    """Where two metrics files differ, timings and `ignored` keys aside ([] when equal)."""
    def same(a, b) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    if [r["step"] for r in reference] != [r["step"] for r in run]:
        return [f"steps {[r['step'] for r in run]} against {[r['step'] for r in reference]}"]
    found = []
    for expected, got in zip(reference, run):
        for key in sorted(set(expected) | set(got)):
            if key.endswith(TIMING_KEYS) or key in ignored or same(expected.get(key), got.get(key)):
                continue
            found.append(f"step {expected['step']} {key}: {got.get(key)!r} against {expected.get(key)!r}")
    return found


class Watch:
    """One trainer process seen through its run directory and its children, polled every POLL_S."""

    def __init__(self, process: subprocess.Popen, out: Path):
        self.process, self.out, self.started = process, out, time.time()
        self.worker_seen = False  # whether a reward worker ran during the last `wait`

    def wait(self, seconds: float) -> None:
        """Sleep, watching for reward workers."""
        deadline, self.worker_seen = time.time() + seconds, False
        while time.time() < deadline:
            self.worker_seen = self.worker_seen or bool(self.workers())
            time.sleep(POLL_S)

    def until(self, condition, timeout_s: float = 300.0, poll_s: float = POLL_S):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = condition()
            if value:
                return value
            if self.process.poll() is not None:
                raise RuntimeError(f"the trainer exited ({self.process.returncode}) before the moment came")
            time.sleep(poll_s)
        raise TimeoutError("the moment never came")

    def workers(self) -> list[int]:
        """Live reward workers: forked children, with the trainer's own command line (Ray's processes have others)."""
        table, command = process_table(), " ".join(self.process.args)
        return [p for p, (ppid, state) in table.items()
                if ppid == self.process.pid and state != "Z" and command_line(p) == command]

    def tmp_checkpoint(self, step: int) -> Path:
        return self.out / "checkpoints" / f".tmp_step_{step:06d}"

    def pause_worker_done(self) -> None:
        """Returns when a reward worker seen alive for over half of PAUSE_S (the pause worker) has exited."""
        alive_from_to: dict[int, list[float]] = {}
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the trainer exited ({self.process.returncode}) before the moment came")
            live, now = set(self.workers()), time.time()
            for pid in live:
                alive_from_to.setdefault(pid, [now, now])[1] = now
            if any(pid not in live and last - first > PAUSE_S / 2 for pid, (first, last) in alive_from_to.items()):
                return
            time.sleep(POLL_S)

    def seen(self, step: int) -> str:
        """What this moment looks like from outside: what landed where."""
        parts = []
        if self.workers():
            parts.append("reward worker alive")
        tmp = self.tmp_checkpoint(step)
        if tmp.exists() and tmp.stat().st_mtime >= self.started:  # not one an earlier kill left
            parts.append(f".tmp_step_{step} being written")
        if step in [r["step"] for r in records(self.out)]:
            parts.append(f"step {step} logged")
        return ", ".join(parts) or f"no worker{' (one ran before)' if self.worker_seen else ''}, step {step} not logged"


def aim(watch: Watch, phase: str, resumed: int, rng: random.Random, checkpoint_s: float) -> int:
    """Wait for a moment of `phase` in a step after `resumed`; returns that step. Rollout and update
    kills fall in the second step after the resume: the first runs whole, its checkpoint is the
    anchor and its logged times (this process's, under the machine's load now) the guide."""
    step = resumed + 2 if phase in ("rollout", "update") else resumed + rng.choice((1, 2))
    if step > resumed + 1:
        watch.until(lambda: step - 1 in checkpoint_steps(watch.out))
        before = next(r for r in records(watch.out) if r["step"] == step - 1)
    if phase == "rollout":  # no reward worker may run before the kill
        watch.wait(rng.uniform(0.1, 0.8) * before["rollout_s"])
    elif phase == "reward":
        watch.until(watch.workers)
        time.sleep(rng.uniform(0.0, 0.7) * PAUSE_S)
    elif phase == "checkpoint":
        watch.until(lambda: watch.tmp_checkpoint(step).exists(), poll_s=POLL_S / 10)
        time.sleep(rng.uniform(0.0, 0.5) * checkpoint_s)
    else:
        watch.pause_worker_done()  # then no reward worker may run before the kill (an evaluation's would)
        watch.wait(before["recompute_s"] + rng.uniform(0.2, 0.8) * before["update_s"])
    return step


def kill_and_check(watch: Watch, step: int) -> dict:
    seen = watch.seen(step)
    tree = descendants(watch.process.pid)
    watch.process.kill()
    watch.process.wait()
    gone_s, last = leftovers(tree, limit_s=10.0)
    return {"seen": seen, "tree": len(tree), "gone_s": gone_s, "orphans": [n for n in last if n.startswith("left:")],
            "lock_free": lock_is_free(watch.out)}


def measure_checkpoint_write(process: subprocess.Popen, out: Path) -> float:
    """Median seconds a checkpoint's temporary directory exists, watched while `process` runs."""
    times = []
    while process.poll() is None:
        names = os.listdir(out / "checkpoints") if (out / "checkpoints").is_dir() else []
        tmp = next((out / "checkpoints" / n for n in names if n.startswith(".tmp_")), None)
        if tmp is not None:
            began = time.time()
            while tmp.exists():
                time.sleep(POLL_S / 10)
            times.append(time.time() - began)
        time.sleep(POLL_S / 10)
    return sorted(times)[len(times) // 2] if times else 0.05


def run_kill_soak(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-kill-"))
    reference_out, soak_out = work / "reference", work / "soak"
    reference_process = start(train_command(reference_out, args.steps, 4), work / "reference.log")
    checkpoint_s = measure_checkpoint_write(reference_process, reference_out)
    if reference_process.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed; see {work / 'reference.log'}")
    rng = random.Random(args.seed)
    plan = [PHASES[i % len(PHASES)] for i in range(args.kills)]
    rng.shuffle(plan)
    kills = []
    for number, phase in enumerate(plan, start=1):
        resumed = max(checkpoint_steps(soak_out), default=0)
        if resumed + 2 > args.steps:
            raise SystemExit(f"--steps {args.steps} is too few for {args.kills} kills; give more")
        flags = ["--resume"] if resumed else ["--resume", "auto"]
        watch = Watch(start(train_command(soak_out, args.steps, 4, *flags), work / "soak.log"), soak_out)
        step = aim(watch, phase, resumed, rng, checkpoint_s)
        kills.append({"kill": number, "phase": phase, "resumed_from": resumed, "step": step,
                      **kill_and_check(watch, step)})
        print(f"kill {number}: {phase} at step {step} (resumed from {resumed}): {kills[-1]['seen']}", flush=True)
    final = start(train_command(soak_out, args.steps, 4, "--resume"), work / "soak.log")
    final.wait()
    return {"work": str(work), "steps": args.steps, "checkpoint_write_s": checkpoint_s, "kills": kills,
            "final_exit": final.returncode, "metric_differences": differences(records(reference_out), records(soak_out)),
            "weights_equal": weights_digest(reference_out, args.steps) == weights_digest(soak_out, args.steps)}


def ray_workers(trainer: int) -> dict[int, str]:
    """{pid: process title} of the rollout actors of `trainer`'s Ray cluster."""
    titles = {p: command_line(p) for p in descendants(trainer)}
    return {p: title for p, title in titles.items() if title.startswith("ray::RolloutWorker")}


def kill_a_sampling_worker(watch: Watch, step: int) -> dict:
    """SIGKILL a rollout worker while it samples `step`, and wait for its replacement."""
    watch.until(lambda: step - 1 in checkpoint_steps(watch.out))
    busy = watch.until(lambda: [p for p, title in ray_workers(watch.process.pid).items() if "generate" in title])
    before = set(ray_workers(watch.process.pid))
    os.kill(busy[0], signal.SIGKILL)
    killed_at = time.time()
    new = watch.until(lambda: set(ray_workers(watch.process.pid)) - before)
    return {"step": step, "killed": f"rollout worker {busy[0]} (sampling)",
            "seen": f"replaced by {min(new)} after {time.time() - killed_at:.1f} s"}


def run_ray_soak(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-ray-"))
    reference_out, soak_out = work / "reference", work / "soak"
    ray_flags = ("--rollout-workers", "2", "--rollout-shards", "2")
    reference_process = start(train_command(reference_out, args.steps, 3, *ray_flags), work / "reference.log")
    if reference_process.wait() != 0:
        raise SystemExit(f"the uninterrupted Ray run failed; see {work / 'reference.log'}")
    watch = Watch(start(train_command(soak_out, args.steps, 3, *ray_flags), work / "soak.log"), soak_out)
    events = [kill_a_sampling_worker(watch, step) for step in (2, 4)]
    step = args.steps - 1  # then the trainer itself, while a worker samples
    watch.until(lambda: step - 1 in checkpoint_steps(soak_out))
    watch.until(lambda: [p for p, title in ray_workers(watch.process.pid).items() if "generate" in title])
    tree = descendants(watch.process.pid)
    watch.process.kill()
    watch.process.wait()
    lock_free = lock_is_free(soak_out)
    final = start(train_command(soak_out, args.steps, 3, *ray_flags, "--resume"), work / "soak.log")  # at once
    gone_s, last = leftovers(tree, limit_s=180.0, ours=(final.pid,))
    events.append({"step": step, "killed": "trainer (a worker sampling)", "tree": len(tree), "gone_s": gone_s,
                   "seen": f"resumed at once; the last to go: {', '.join(last) or '-'}", "lock_free": lock_free,
                   "orphans": [name for name in last if name.startswith("left:")]})
    final.wait()
    run = records(soak_out)
    return {"work": str(work), "steps": args.steps, "events": events, "final_exit": final.returncode,
            "retries": {r["step"]: r.get("rollout_retries") for r in run if r.get("rollout_retries")},
            "metric_differences": differences(records(reference_out), run, ignored=("rollout_retries",)),
            "weights_equal": weights_digest(reference_out, args.steps) == weights_digest(soak_out, args.steps)}


def memory_status(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (the most ever resident) of `pid`, in bytes; {} once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.startswith(("VmRSS", "VmHWM"))}


def run_memory_soak(args) -> dict:
    """RSS every 0.1 s, grouped by the step in progress (the one after the last logged). Within a step
    RSS swings by a quarter (the update's and the evaluation's buffers come and go), and a step's floor
    moves by up to a third as the allocator keeps or returns freed memory; so the bound is held on means
    over 50 steps, those from step 50 against the last 50: each step's floor (what stays resident from
    one step to the next) and peak, and VmHWM (the most ever resident) at step 50 against the end."""
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-memory-"))
    out = work / "run"
    command = [sys.executable, "-m", "sparserl.cli", "train", "--mode", "sparse-rl", "--threads", "1",
               "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--out", str(out)]
    process = start(command, work / "train.log")
    windows: dict[int, list[int]] = {}  # step in progress: its RSS samples
    high_water: dict[int, int] = {}  # step in progress: VmHWM at its end
    offset, lines, began = 0, 0, time.time()
    while process.poll() is None:
        status = memory_status(process.pid)
        if (out / "metrics.jsonl").exists():
            with open(out / "metrics.jsonl", "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
        step = lines - (1 if args.eval_every else 0) + 1  # step 0's evaluation is a line of its own
        if status and 1 <= step <= args.steps:
            windows.setdefault(step, []).append(status["VmRSS"])
            high_water[step] = status["VmHWM"]
        time.sleep(0.1)
    floors = {step: min(samples) for step, samples in windows.items()}
    peaks = {step: max(samples) for step, samples in windows.items()}
    base = min(50, args.steps // 2)
    first = [s for s in floors if base <= s < base + 50]
    last = sorted(floors)[-len(first):]
    ratios = {"floor": fmean(floors[s] for s in last) / fmean(floors[s] for s in first),
              "peak": fmean(peaks[s] for s in last) / fmean(peaks[s] for s in first),
              "high_water": high_water[max(last)] / high_water[base]}
    later = [s for s in floors if s >= base]
    return {"work": str(work), "command": " ".join(command[2:]), "exit": process.returncode,
            "seconds": round(time.time() - began), "base_step": base, "windows": [[min(first), max(first)],
                                                                                 [min(last), max(last)]],
            "ratios": ratios, "within_5pct": all(abs(r - 1) <= 0.05 for r in ratios.values()),
            "floor_range": [min(floors[s] for s in later), max(floors[s] for s in later)],
            "peak_max": max(peaks[s] for s in later), "floor_base": floors[base],
            "curve": {s: (floors[s], peaks[s], high_water[s]) for s in (1, 10, 50, 100, 200, 300, 400, args.steps)
                      if s in floors},
            "floors": floors, "peaks": peaks, "high_water": high_water}


def print_report(kind: str, result: dict) -> None:
    mib = 1 << 20
    if kind == "memory":
        print("\n| step | floor RSS (MiB) | peak RSS (MiB) | VmHWM (MiB) |\n|---|---|---|---|")
        for step, (floor, peak, high_water) in result["curve"].items():
            print(f"| {step} | {floor / mib:.1f} | {peak / mib:.1f} | {high_water / mib:.1f} |")
        (a, b), (c, d) = result["windows"]
        print(f"\nsteps {c}-{d} against {a}-{b}: mean floor x{result['ratios']['floor']:.4f}, mean peak "
              f"x{result['ratios']['peak']:.4f}; VmHWM at step {d} against step {a}: x{result['ratios']['high_water']:.4f}; "
              f"within 5%: {result['within_5pct']}")
        print(f"single steps from {a}: floor {result['floor_range'][0] / mib:.1f} to {result['floor_range'][1] / mib:.1f} "
              f"MiB (step {a}: {result['floor_base'] / mib:.1f}), peak up to {result['peak_max'] / mib:.1f}; "
              f"exit {result['exit']}, {result['seconds']} s")
        return
    rows = result["kills"] if kind == "kill" else result["events"]
    print("\n| # | killed at | step | seen at the kill | processes | all gone after (s) | orphans | lock free |\n"
          "|---|---|---|---|---|---|---|---|")
    for number, row in enumerate(rows, start=1):
        print(f"| {number} | {row.get('phase') or row['killed']} | {row['step']} | {row.get('seen', '')} | "
              f"{row.get('tree', '')} | {row.get('gone_s', '')} | {len(row.get('orphans', []))} | "
              f"{row.get('lock_free', '')} |")
    orphans = [o for row in rows for o in row.get("orphans", [])]
    print(f"\nfinal resume exit {result['final_exit']}; metrics differing from the uninterrupted run: "
          f"{len(result['metric_differences'])}; final weights byte-identical: {result['weights_equal']}; "
          f"orphans: {orphans or 0}; locks left: {sum(not row.get('lock_free', True) for row in rows)}")
    for line in result["metric_differences"][:20]:
        print("  ", line)
    if kind == "ray":
        print(f"rollout retries by step: {result['retries']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("kill", "ray", "memory"))
    parser.add_argument("--steps", type=int, help="training steps (kill: 24, ray: 6, memory: 500)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=10, help="memory: the run's --eval-every")
    parser.add_argument("--seed", type=int, default=0, help="kill: the seed of the kill moments")
    parser.add_argument("--work", help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    args.steps = args.steps or {"kill": 24, "ray": 6, "memory": 500}[args.kind]
    become_subreaper()
    result = {"kill": run_kill_soak, "ray": run_ray_soak, "memory": run_memory_soak}[args.kind](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print_report(args.kind, result)


if __name__ == "__main__":
    main()
