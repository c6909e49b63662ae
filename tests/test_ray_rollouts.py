"""Rollouts on Ray workers, on a local Ray started with ray.init(num_cpus=2): two workers give the
metrics of in-process sampling with the same shards (resume included), a killed or hung worker is
replaced and its shard sampled again with the same data, and a missing Ray is a clear error."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import ray
import torch
from safetensors.torch import load_file

from sparserl.cli import main
from sparserl.config.schema import load_config
from sparserl.rollout.dispatch.ray_workers import (
    arrays_from_tensors,
    tensors_from_arrays,
)
from sparserl.train.metrics import read_metrics
from sparserl.train.trainer import GRPOTrainer

# Wall-clock figures differ between any two runs; everything else must be equal.
TIMING_KEYS = {"rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac",
               "weight_push_s", "weight_load_s", "rollout_compute_s", "rollout_transfer_s"}
# Counted only when a worker was lost: what must not change is everything else.
FAULT_KEYS = {"rollout_retries", "rollout_timeouts"}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _settings(model_dir, out, **extra):
    return {"model": str(model_dir), "out": str(out), "mode": "sparse-rl", "seed": 5, "prompts_per_step": 4,
            "group_size": 4, "difficulty": 4, "eval_examples": 8, "eval_every": 2, "checkpoint_every": 1,
            "threads": 1, "kv_budget": 10, "kv_window": 3, "kv_interval": 3, "log_with": "none", "lr": 3e-3,
            "entropy_coef": 0.05, **extra}


def _argv(settings: dict, steps: int, *flags: str) -> list[str]:
    argv = ["train", "--steps", str(steps), *flags]
    for key, value in settings.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def _comparable(path, drop=frozenset()):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS | drop} for r in read_metrics(path / "metrics.jsonl")]


@pytest.mark.slow  # 53 s; workers = in-process stays in the default suite (built-in model)
def test_two_workers_equal_in_process_shards_with_distill_sparse_and_resume(local_ray, tiny_model_dir, tmp_path):
    common = {"distill_sparse": "true", "distill_rank": 2}
    local = _settings(tiny_model_dir, tmp_path / "local", rollout_shards=2, **common)
    workers = _settings(tiny_model_dir, tmp_path / "workers", rollout_workers=2, **common)
    assert main(_argv(local, 3)) == 0
    assert main(_argv(workers, 2)) == 0
    assert main(_argv(workers, 3, "--resume")) == 0
    in_process, on_workers = _comparable(tmp_path / "local"), _comparable(tmp_path / "workers")
    assert [r["step"] for r in on_workers] == [0, 1, 2, 3]
    assert in_process == on_workers
    assert all(r["rollout_retries"] == 0 for r in on_workers[1:])
    # The weights (policy and adapter) ended identical, and training moved them.
    for part in ("policy/model.safetensors", "sampler_adapter/adapter.safetensors"):
        a = load_file(tmp_path / "local" / "checkpoints" / "step_000003" / part)
        b = load_file(tmp_path / "workers" / "checkpoints" / "step_000003" / part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_built_in_model_samples_on_workers_as_in_process(local_ray, tmp_path):
    """The shipped model, default threads: its weights load from the package's safetensors file in the
    driver and from the object store in a worker, and the two still sample bit for bit."""
    common = {"out": None, "mode": "sparse-rl", "seed": 5, "prompts_per_step": 4, "eval_every": 0,
              "log_with": "none"}
    assert main(_argv({**common, "out": str(tmp_path / "local"), "rollout_shards": 2}, 2)) == 0
    assert main(_argv({**common, "out": str(tmp_path / "workers"), "rollout_workers": 2}, 2)) == 0
    assert _comparable(tmp_path / "local") == _comparable(tmp_path / "workers")


@pytest.mark.slow  # 17 s
def test_a_worker_samples_with_the_drivers_thread_count(local_ray, tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(load_config(None, _settings(tiny_model_dir, tmp_path / "run", rollout_workers=2,
                                                      threads=2)))
    try:
        counts = ray.get([w.__ray_call__.remote(lambda worker: torch.get_num_threads())
                          for w in trainer.rollouts.workers])
    finally:
        trainer.rollouts.close()
        torch.set_num_threads(1)  # the trainer set the process's count: the other tests run on one
    assert counts == [2, 2]


@pytest.mark.slow  # 20 s
def test_speculative_rollouts_on_workers_are_the_exact_dense_samples_of_in_process(local_ray, tiny_model_dir,
                                                                                   tmp_path):
    """Workers build the speculative sampler the config asks for (not a plain or block-sparse engine): the same
    shards sample the same tokens as in process, their log-probs are the dense policy's (ξ = 1), and the
    acceptance counts come back from the workers."""
    speculative = {"speculative": "true", "speculative_draft": "block", "kv_budget": 12, "block_page_size": 4,
                   "block_dense_layers": 0, "draft_tokens": 3, "eval_every": 0, "max_new_tokens": 24,
                   "ignore_eos": "true"}
    assert main(_argv(_settings(tiny_model_dir, tmp_path / "local", rollout_shards=2, **speculative), 2)) == 0
    assert main(_argv(_settings(tiny_model_dir, tmp_path / "workers", rollout_workers=2, **speculative), 2)) == 0
    spec_timings = {"spec_draft_s", "spec_verify_s"}
    in_process, on_workers = _comparable(tmp_path / "local", spec_timings), _comparable(tmp_path / "workers",
                                                                                      spec_timings)
    assert in_process == on_workers
    for record in on_workers:
        assert 0 < record["spec_acceptance_rate"] < 1  # the draft is sparse: some drafts were rejected
        assert abs(record["xi_min"] - 1) < 1e-5 and abs(record["xi_max"] - 1) < 1e-5  # exact dense samples


@pytest.mark.slow  # 18 s
def test_workers_hold_the_sampler_adapter_and_no_optimizer(local_ray, tiny_model_dir, tmp_path):
    def _optimizers_held(worker) -> tuple[bool, int]:
        """In a worker (nested, so that Ray ships it by value): whether it holds the adapter, and
        how many optimizers live in its process."""
        import gc

        import torch

        return worker.adapter is not None, sum(isinstance(o, torch.optim.Optimizer) for o in gc.get_objects())

    settings = _settings(tiny_model_dir, tmp_path / "run", rollout_workers=2, distill_sparse="true", distill_rank=2)
    trainer = GRPOTrainer(load_config(None, settings))
    try:
        held = ray.get([w.__ray_call__.remote(_optimizers_held) for w in trainer.rollouts.workers])
    finally:
        trainer.rollouts.close()
    assert held == [(True, 0), (True, 0)]
    assert trainer.parts.distill.optimizer is not None  # the driver trains the adapter


def _trainer_with_fault(settings: dict, fault) -> tuple[GRPOTrainer, threading.Thread]:
    """A trainer whose first rollout request sets off `fault(pids)` from another thread."""
    trainer = GRPOTrainer(load_config(None, settings))
    pids = ray.get([worker.pid.remote() for worker in trainer.rollouts.workers])
    requested = threading.Event()
    generate = trainer.rollouts.generate

    def generate_and_signal(*args, **kwargs):
        requested.set()
        return generate(*args, **kwargs)

    trainer.rollouts.generate = generate_and_signal
    thread = threading.Thread(target=lambda: (requested.wait(60), fault(pids)), daemon=True)
    thread.start()
    return trainer, thread


@pytest.mark.parametrize("fault", ["sigkill", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_lost_worker_is_replaced_and_its_shard_sampled_again(local_ray, tiny_model_dir, tmp_path, fault):
    # Long responses, so that the fault lands while the shards are being sampled.
    long = {"max_new_tokens": 160, "ignore_eos": "true", "eval_every": 0, "checkpoint_every": 2}
    assert main(_argv(_settings(tiny_model_dir, tmp_path / "local", rollout_shards=2, **long), 2)) == 0
    settings = _settings(tiny_model_dir, tmp_path / "workers", steps=2, rollout_workers=2, **long)
    if fault == "hang":
        settings["rollout_timeout"] = 4.0
        signal_to_send = signal.SIGSTOP  # the process stays, but answers nothing
    else:
        signal_to_send = signal.SIGKILL
    trainer, thread = _trainer_with_fault(settings, lambda pids: os.kill(pids[0], signal_to_send))
    trainer.train()
    thread.join()
    records = read_metrics(tmp_path / "workers" / "metrics.jsonl")
    assert sum(r["rollout_retries"] for r in records) >= 1
    timeouts = sum(r["rollout_timeouts"] for r in records)
    assert timeouts >= 1 if fault == "hang" else timeouts == 0
    assert _comparable(tmp_path / "local", FAULT_KEYS) == _comparable(tmp_path / "workers", FAULT_KEYS)


def test_without_ray_installed_workers_are_a_clear_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when the extra is not installed
    assert main(_argv(_settings(tiny_model_dir, tmp_path / "run", rollout_workers=2), 1)) == 2
    error = capsys.readouterr().err
    assert 'pip install -e ".[ray]"' in error and "--rollout-workers 0" in error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_survive_the_trip_through_numpy_bitwise(dtype):
    state = {"w": torch.randn(3, 5).to(dtype), "b": torch.randn(7).to(dtype)[::2]}  # a strided view too
    back = tensors_from_arrays(arrays_from_tensors(state))
    assert all(back[k].dtype == dtype and torch.equal(back[k], state[k]) for k in state)


def test_an_unreachable_cluster_is_a_clear_error_in_seconds(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever an earlier test left running
    settings = _settings(tiny_model_dir, tmp_path / "run", rollout_workers=2, ray_address="127.0.0.1:9")
    assert main(_argv(settings, 1)) == 2
    error = capsys.readouterr().err
    assert "--ray-address 127.0.0.1:9: cannot join a Ray cluster" in error and "ray status" in error
