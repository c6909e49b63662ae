"""A training run's output directory: one run per directory, one process at a time.

`open_run_dir` is the only way a trainer gets its directory. It refuses, with a message that says
what to do, every case that would mix two runs or resume the wrong one:

- a directory that already holds a run, without `--resume` (or `--overwrite`, which deletes the run's own files
  and nothing else), and `--resume` with `--overwrite`;
- a directory that holds no run but other files (a comparison, a user's data): a run needs its own;
- `--resume` on a directory without a usable checkpoint (`--resume auto` starts fresh instead);
- `--resume` with a config that changes anything defining the run (`RUN_FREE_FIELDS` may change;
  `--allow-config-change` lets the rest change, with a warning that lists it);
- a second process on the same directory: an exclusive OS lock (`flock`), released on exit and on
  a crash, names the holder's pid. A process forked from the holder (a reward worker) closes its
  copy of the lock at once, so that a child outliving a killed trainer cannot keep the lock.
A run that fails before it has logged anything leaves no directory behind.

`StopRequest` turns Ctrl-C and SIGTERM into a request the training loop honours at the next step
boundary, after a checkpoint.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import yaml

from ..config.schema import ExperimentConfig, save_config
from ..errors import ConfigError
from .layout import CHECKPOINT_DIR, CONFIG_FILE, LOCK_FILE, METRICS_FILE, RUN_ENTRIES

# Fields that may differ on resume without changing what the run is: its length and its logging.
# Where the rollouts run, and how many rows run at once, do not change the data (the shards do, and
# they are not in this set). How the decode step runs (compile_decode) is not free: compiled, its float sums round
# otherwise, so a run keeps the one it started with.
RUN_FREE_FIELDS = frozenset({"steps", "out", "checkpoint_every", "keep_checkpoints", "eval_every",
                             "log_with", "threads", "ray_address", "rollout_timeout", "worker_gpus", "worker_cpus",
                             "rollout_backend", "rollout_kv_memory", "max_concurrent_rows"})
Resume = Literal["never", "must", "auto"]
# The lock files this process holds. An flock belongs to the open file, which a fork shares: a child
# that kept its copy would keep the lock for as long as it lives.
_held_locks: set = set()


def _drop_inherited_locks() -> None:
    """In a forked child: close (never unlock: the lock is the parent's) the lock files it inherited."""
    for handle in _held_locks:
        handle.close()
    _held_locks.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, current)} over the leaves of two nested config dicts (lists and tuples equal).

    A field the saved config lacks was added after the run was made: it counts as its default, so a
    new option left alone does not stop a resume."""
    def leaves(tree: dict) -> dict[str, Any]:
        flat = {}
        for value in tree.values():
            if isinstance(value, dict):
                flat.update({k: list(v) if isinstance(v, tuple) else v for k, v in value.items()})
        return flat

    old, new = leaves(saved), leaves(current)
    defaults = leaves(ExperimentConfig().to_dict())
    old.update({k: defaults[k] for k in new.keys() - old.keys() if k in defaults})
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


@dataclass
class RunDir:
    path: Path
    resume_checkpoint: Path | None
    _lock_handle: Any = None
    _created: bool = False

    def release(self, failed: bool) -> None:
        """Drop the lock; after a failure, remove a directory this run created and never wrote to."""
        if self._lock_handle is not None:
            _held_locks.discard(self._lock_handle)
            self._lock_handle.close()
            self._lock_handle = None
        logged = (self.path / METRICS_FILE).exists() or (self.path / CHECKPOINT_DIR).exists()
        if failed and self._created and not logged:
            shutil.rmtree(self.path, ignore_errors=True)


def holds_a_run(path: Path) -> bool:
    return any((path / name).exists() for name in (METRICS_FILE, CHECKPOINT_DIR, CONFIG_FILE))


def check_output_dir(out: str | Path) -> Path:
    """`--out` as a directory that may not exist yet: refused if it is a file, before any work."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; give a directory (it is created if missing)")
    return path


def make_output_dir(out: str | Path) -> tuple[Path, bool]:
    """`--out` as a directory, created if missing: (its path, whether this call created it)."""
    path = check_output_dir(out)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {path}: cannot create the directory ({error.strerror}); "
                          "choose a writable location") from None
    return path, created


def open_run_dir(config: ExperimentConfig, resume: Resume = "never", overwrite: bool = False,
                 allow_config_change: bool = False) -> RunDir:
    from .checkpoint import latest_good_checkpoint

    if overwrite and resume != "never":
        raise ConfigError("--overwrite deletes the run that --resume would continue: pass one of them")
    path, created = make_output_dir(config.output.out)
    _refuse_foreign_files(path)
    handle = _lock(path)
    run = RunDir(path, None, handle, created)
    try:
        if overwrite and holds_a_run(path):
            _empty(path)
        checkpoint = latest_good_checkpoint(path) if resume != "never" else None
        if resume == "never" and holds_a_run(path):
            raise ConfigError(f"--out {path} already holds a run; add --resume to continue it, or --overwrite "
                              "to delete it and start again")
        if resume == "must" and checkpoint is None:
            raise ConfigError(f"--resume: no usable checkpoint under {path / 'checkpoints'}; check --out, or pass "
                              "--resume auto to start from scratch when there is none")
        if checkpoint is not None:
            _check_config(path, config, allow_config_change)
        elif holds_a_run(path):  # --resume auto without a checkpoint: start again from nothing
            _empty(path)
        run.resume_checkpoint = checkpoint
        save_config(config, path / CONFIG_FILE)
    except BaseException:
        run.release(failed=True)
        raise
    return run


def _refuse_foreign_files(path: Path) -> None:
    """A directory that holds no run may hold nothing but what a run writes: a run never deletes a user's files."""
    foreign = sorted(entry.name + "/" * entry.is_dir() for entry in path.iterdir() if not _is_run_entry(entry.name))
    if foreign and not holds_a_run(path):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"--out {path} holds files that are not a training run's ({shown}); a run needs a "
                          "directory of its own: choose a new or empty --out")


def _lock(path: Path) -> TextIO:
    """The run directory's lock file, locked by this process (its pid written in it), or a ConfigError naming the
    process that holds it."""
    try:
        handle = open(path / LOCK_FILE, "a+")
    except OSError as error:
        raise ConfigError(f"--out {path}: cannot write there ({error.strerror}); choose a writable location") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(f"--out {path} is in use by another sparserl process (pid {holder}); wait for it to "
                          "finish or choose another --out") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _held_locks.add(handle)
    return handle


def _is_run_entry(name: str) -> bool:
    # A crash can leave an atomic write's temporary behind (final_eval.json.tmp, metrics.tmp): the run's too.
    return name in RUN_ENTRIES or name.endswith(".tmp") and any(
        name in (entry + ".tmp", Path(entry).stem + ".tmp") for entry in RUN_ENTRIES)


def _empty(path: Path) -> None:
    """Delete the run in a directory, but the lock this process holds: only what a run writes, so that a user's own
    files beside it (notes, an evaluation written there) stay."""
    for child in path.iterdir():
        if child.name != LOCK_FILE and _is_run_entry(child.name):
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def _check_config(path: Path, config: ExperimentConfig, allow_change: bool) -> None:
    saved_file = path / CONFIG_FILE
    if not saved_file.exists():
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    changed = {k: v for k, v in config_differences(saved, config.to_dict()).items() if k not in RUN_FREE_FIELDS}
    if not changed:
        return
    listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
    if not allow_change:
        raise ConfigError(f"--resume: the config differs from the run's saved one in {listing}. Resume with the "
                          "run's own settings, or pass --allow-config-change to continue with the new ones")
    warnings.warn(f"--allow-config-change: resuming {path} with changed settings: {listing}")


class StopRequest:
    """While active, SIGINT and SIGTERM set `requested` instead of killing the process, so the loop
    can finish its step and checkpoint; a second signal interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
