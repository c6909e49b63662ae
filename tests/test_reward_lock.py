"""Reward workers and the run directory's lock: a forked worker must neither keep the lock nor outlive
its trainer, and Ctrl-C is the trainer's alone to answer.

The defects these tests keep away: a trainer SIGKILLed while a reward call hung left the worker
running, holding the run's `flock`, so `--resume` was refused ("in use by another sparserl
process"); and Ctrl-C, which reaches the whole foreground process group, made every reward worker
run the trainer's handler and print "finishing this step" too.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sparserl.cli import main
from sparserl.config.schema import load_config
from sparserl.train.metrics import read_metrics
from sparserl.train.run_dir import open_run_dir

# A reward that scores 1 until the run has its first checkpoint, then (where the environment says
# so) writes its pid and sleeps: a reward call that hangs, at a moment the test can see.
HANGING_REWARD = '''
import os, time
from pathlib import Path

def hang_after_first_checkpoint(completions, **_):
    where = os.environ.get("SPARSERL_TEST_HANG_DIR")
    if where and (Path(where) / "out" / "checkpoints" / "step_000001").exists():
        (Path(where) / "worker.pid").write_text(str(os.getpid()))
        time.sleep(float(os.environ["SPARSERL_TEST_HANG_S"]))
    return [1.0] * len(completions)
'''


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (a container's init may never reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _train(model, tmp_path: Path, steps: int) -> list[str]:
    reward = tmp_path / "hang.py"
    reward.write_text(HANGING_REWARD)
    return ["train", "--model", str(model), "--out", str(tmp_path / "out"), "--steps", str(steps),
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--minibatches", "1",
            "--eval-every", "0", "--checkpoint-every", "1", "--threads", "1", "--log-with", "none",
            "--reward-funcs", f"task,{reward}:hang_after_first_checkpoint", "--reward-timeout", "300"]


def _start_hanging(argv: list[str], tmp_path: Path, hang_s: float, **popen) -> tuple[subprocess.Popen, int]:
    """The trainer in a subprocess, and the pid of its reward worker once that hangs."""
    env = {**os.environ, "SPARSERL_TEST_HANG_DIR": str(tmp_path), "SPARSERL_TEST_HANG_S": str(hang_s)}
    process = subprocess.Popen([sys.executable, "-m", "sparserl.cli", *argv], env=env, **popen)
    pid_file = tmp_path / "worker.pid"
    deadline = time.time() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        assert process.poll() is None, "the trainer ended before its reward call hung"
        time.sleep(0.05)
    return process, int(pid_file.read_text())


def test_a_trainer_killed_during_a_reward_call_leaves_no_worker_and_can_resume(tiny_model_dir, tmp_path):
    argv = _train(tiny_model_dir, tmp_path, steps=2)
    trainer, worker = _start_hanging(argv, tmp_path, hang_s=120, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
    try:
        trainer.kill()
        trainer.wait()
        deadline = time.time() + 5
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the reward worker outlived its SIGKILLed trainer"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert main([*argv, "--resume"]) == 0  # the lock went with the trainer
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow  # 13 s; Ctrl-C at a step boundary stays in the default suite (test_hardening.py)
def test_ctrl_c_during_a_reward_call_is_answered_by_the_trainer_alone(tiny_model_dir, tmp_path):
    trainer, _ = _start_hanging(_train(tiny_model_dir, tmp_path, steps=3), tmp_path, hang_s=1.5,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
    os.killpg(trainer.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    _, err = trainer.communicate(timeout=120)
    assert err.count("finishing this step") == 1, err
    # The worker ignored the signal and finished its call: the step ended with its reward, no failure.
    assert trainer.returncode == 130 and "interrupted at step 2" in err, err
    record = read_metrics(tmp_path / "out" / "metrics.jsonl")[-1]
    assert record["step"] == 2 and record["reward_hang_after_first_checkpoint_mean"] == 1.0
    assert record["reward_failures"] == 0


def _say_ready_then_sleep(ready) -> None:
    ready.set()
    time.sleep(60)


def test_a_forked_child_does_not_hold_the_run_lock(tiny_model_dir, tmp_path):
    config = load_config(None, {"out": str(tmp_path / "run"), "model": str(tiny_model_dir)})
    holder = open_run_dir(config)
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=_say_ready_then_sleep, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(30)  # the child runs: what it was going to drop at the fork, it has dropped
        holder.release(failed=False)
        again = open_run_dir(config, resume="auto")  # refused "in use" if the child kept the lock
        again.release(failed=False)
    finally:
        child.kill()
        child.join()
