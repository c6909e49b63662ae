"""Rollouts on Ray actors: the driver keeps the learner, N `RolloutWorker`s sample the step's shards.

Shape as in OpenRLHF and verl: each worker is a Ray actor holding a copy of the policy (built from
the driver's model config, so no model files are needed on other machines) and DistillSparse's adapter when
there is one; each request carries the step's `SamplerSpec`, from which the worker builds exactly the sampler
the driver would (dense, sparse, block-sparse or speculative), once per spec. After each update the
driver puts the new weights in the object store once (`sync_weights`: one `ray.put` per step, not
per worker); a worker fetches them when a request names a version it does not hold, and every
result says which version it sampled with, which the driver checks.

Shards are handed to whichever worker is free. A worker that dies, or takes longer than
`rollout_timeout` for a shard, is killed and replaced and the shard is sampled again: with the same
prompts, weights and seed, so the step gets exactly the data it would have had.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import ConfigError
from ...model.clock import now
from ...model.loading import resolve_device
from ..adapter import AdapterConfig, SamplerAdapter, adapter_config
from ..batch import SamplingConfig
from .backends import register_backend
from .shards import Shard, ShardResult, StepRollouts, fold_stats, move_to, sample_shard
from .spec import SamplerCache, SamplerSpec

log = logging.getLogger(__name__)
MAX_SHARD_ATTEMPTS = 3  # a shard that kills this many workers in a row is a bug, not bad luck
POLL_SECONDS = 0.5
START_SECONDS = 120  # beyond rollout_timeout, for a worker to import torch and build its model


@dataclass
class _Flight:
    """One step's shards in flight on the workers: waiting, running (ref -> worker index, shard, submitted at),
    sampled (by shard index, with each round trip's seconds), and the workers free to take one."""

    pending: collections.deque
    idle: list[int]
    running: dict = field(default_factory=dict)
    results: dict[int, ShardResult] = field(default_factory=dict)
    round_trips: dict[int, float] = field(default_factory=dict)
    failures: collections.Counter = field(default_factory=collections.Counter)
    retries: int = 0
    timeouts: int = 0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError('--rollout-workers needs Ray, an optional extra: pip install -e ".[ray]" (or pip install '
                          '"ray>=2.40"); or sample in this process with --rollout-workers 0') from None
    return ray


def arrays_from_tensors(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """A state dict as numpy arrays (with each tensor's dtype), which Ray stores and reads without
    pickling: 2.5 GiB/s to put and a zero-copy get here, against 0.16 GiB/s and 1 GiB/s for tensors.
    Dtypes numpy lacks (bfloat16) travel as same-width integers."""
    arrays = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            arrays[name] = (tensor.view(torch.int16).numpy(), str(tensor.dtype))
        else:
            arrays[name] = (tensor.numpy(), str(tensor.dtype))
    return arrays


def tensors_from_arrays(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    """The inverse of `arrays_from_tensors`; the arrays may be read-only views of the object store
    (load_state_dict copies out of them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(array).view(getattr(torch, dtype.removeprefix("torch.")))
                for name, (array, dtype) in arrays.items()}


def _join(ray, address: str) -> None:
    """`ray.init(address=...)`, with an unreachable HOST:PORT refused in seconds (Ray itself retries
    for minutes) and every failure said as what to check."""
    problem = None
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as error:
            problem = f"nothing answers there ({error})"
    if problem is None:
        try:
            ray.init(address=address)
            return
        except ConnectionError as error:
            problem = str(error)
    raise ConfigError(f"--ray-address {address}: cannot join a Ray cluster: {problem}. Is it running (`ray status` "
                      "on its head node)? Leave --ray-address out to start a local one")


class RolloutWorker:
    """One rollout actor (wrapped by `ray.remote` in `RayRollouts`). Its weights come from the driver, and its
    sampler from each request's `SamplerSpec`: exactly the sampler the driver would build."""

    def __init__(self, model_config, dtype: str, device: str, threads: int, adapter: AdapterConfig | None):
        """`threads`: the driver's torch thread count. The count changes float sums, so a worker samples
        with the driver's, whatever CPUs Ray gave it: its shards are then bit for bit the driver's."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # the random init is overwritten by the first weights; this only makes it cheap to debug
        model = AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, dtype))
        # Parameters keep requires_grad as in the driver: turning it off changes which CPU kernels run
        # (4.8e-7 apart on the built-in model), and the workers must sample bitwise as the driver would.
        self.model = model.to(resolve_device(device)).eval()
        torch.set_num_threads(threads)
        self.adapter = SamplerAdapter(self.model, adapter) if adapter is not None else None
        self.samplers = SamplerCache(self.model)
        self.version = -1

    def pid(self) -> int:
        return os.getpid()

    def generate(self, version: int, weights: list, shard: Shard, sampling: SamplingConfig,
                 spec: SamplerSpec) -> ShardResult:
        """`weights`: `[ObjectRef]` of the driver's state dict at `version` (in a list, so that Ray only
        fetches it when this worker does not hold that version yet)."""
        import ray

        loaded = 0.0
        if version != self.version:
            device = next(self.model.parameters()).device
            started = now(device)
            self.model.load_state_dict(tensors_from_arrays(ray.get(weights[0])))
            self.version = version
            loaded = now(device) - started
        result = sample_shard(self.samplers.get(spec), shard, sampling, self.version, self.adapter)
        result.weight_load_seconds = loaded
        return move_to(result, torch.device("cpu"))


@register_backend("ray")
class RayRollouts:
    """The driver's side: starts the workers, pushes weights, hands out shards, replaces lost workers."""

    @classmethod
    def from_config(cls, config, model, adapter: SamplerAdapter | None, device: torch.device) -> RayRollouts:
        """`config.rollout.rollout_workers` workers holding copies of `model` (with DistillSparse's adapter when
        there is one), sampling with this process's torch thread count."""
        return cls(config.rollout, model.config, config.model.dtype, device, torch.get_num_threads(),
                   adapter_config(config.train) if adapter is not None else None)

    def __init__(self, rollout, model_config, dtype: str, device: torch.device, threads: int,
                 adapter: AdapterConfig | None):
        ray = import_ray()
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if rollout.ray_address:
                _join(ray, rollout.ray_address)
            else:
                ray.init(num_cpus=rollout.rollout_workers * rollout.worker_cpus, include_dashboard=False)
        self.timeout = rollout.rollout_timeout
        self.device = device
        resources = {"num_cpus": rollout.worker_cpus}
        if device.type == "cuda":  # fractions of one GPU colocate workers (and the learner), as OpenRLHF does
            resources["num_gpus"] = rollout.worker_gpus or 1.0 / rollout.rollout_workers
        self.actor = ray.remote(**resources)(RolloutWorker)
        self.worker_args = (model_config, dtype, "cuda" if device.type == "cuda" else "cpu", threads, adapter)
        # A worker takes shards once it has started (`ready`): the timeout must not count its start-up.
        self.workers, self.ready = [], []
        for _ in range(rollout.rollout_workers):
            self._start()
        self.version, self.weights, self.push_seconds = -1, None, 0.0

    def _start(self, index: int | None = None) -> None:
        worker = self.actor.remote(*self.worker_args)
        ready = (worker.pid.remote(), time.perf_counter())
        if index is None:
            self.workers.append(worker)
            self.ready.append(ready)
        else:
            self.workers[index], self.ready[index] = worker, ready

    def _started(self, idle: list[int]) -> list[int]:
        """The idle workers that have started; a replacement that cannot start in time is an error."""
        started = []
        for index in idle:
            ref, since = self.ready[index]
            if self.ray.wait([ref], timeout=0)[0]:
                started.append(index)
            elif time.perf_counter() - since > self.timeout + START_SECONDS:
                raise RuntimeError(f"rollout worker {index} did not start in {self.timeout + START_SECONDS:g} s: "
                                   "are there free CPUs/GPUs in the Ray cluster (`ray status`)?")
        return started

    def sync_weights(self, model, version: int) -> None:
        """Put the model's weights at `version` (updates applied) in the object store, once."""
        if version == self.version:
            return
        started = time.perf_counter()
        self.weights = self.ray.put(arrays_from_tensors(model.state_dict()))
        self.version = version
        self.push_seconds = time.perf_counter() - started

    def generate(self, shards: list[Shard], sampling: SamplingConfig, spec: SamplerSpec) -> StepRollouts:
        started = time.perf_counter()
        flight = _Flight(pending=collections.deque(shards), idle=list(range(len(self.workers))))
        while flight.pending or flight.running:
            self._submit(flight, sampling, spec)
            starting = [self.ready[i][0] for i in flight.idle] if flight.pending else []
            ready, _ = self.ray.wait(list(flight.running) + starting, num_returns=1, timeout=POLL_SECONDS)
            for ref in [ref for ref in ready if ref in flight.running]:
                self._collect(flight, ref)
            self._expire(flight)
        ordered = [flight.results[s.index] for s in shards]
        transfer = [flight.round_trips[r.index] - r.compute_seconds - r.weight_load_seconds for r in ordered]
        timings = {"weight_push_s": self.push_seconds,
                   "weight_load_s": max(r.weight_load_seconds for r in ordered),
                   "rollout_compute_s": sum(r.compute_seconds for r in ordered),
                   "rollout_transfer_s": sum(transfer) / len(transfer)}
        self.push_seconds = 0.0  # counted once, in the step that pushed
        return StepRollouts([move_to(r.batch, self.device) for r in ordered], time.perf_counter() - started,
                            fold_stats(ordered), flight.retries, flight.timeouts, timings)

    def _submit(self, flight: _Flight, sampling: SamplingConfig, spec: SamplerSpec) -> None:
        """Give waiting shards to the idle workers that have started."""
        for index in self._started(flight.idle) if flight.pending else []:
            if not flight.pending:
                break
            flight.idle.remove(index)
            shard = flight.pending.popleft()
            ref = self.workers[index].generate.remote(self.version, [self.weights], shard, sampling, spec)
            flight.running[ref] = (index, shard, time.perf_counter())

    def _collect(self, flight: _Flight, ref) -> None:
        """Take a finished shard's result, or give the shard to another worker if its worker was lost."""
        ray = self.ray
        index, shard, submitted = flight.running.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayTaskError as error:  # the sampling code raised: not a lost worker
            raise error.as_instanceof_cause() from None
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError) as error:
            self._retry(index, shard, flight.pending, flight.failures, f"worker lost ({type(error).__name__})")
            flight.idle.append(index)
            flight.retries += 1
            return
        if result.version != self.version:
            raise RuntimeError(f"shard {shard.index} came back sampled with weights v{result.version}, "
                               f"the driver's are v{self.version}; this is a bug")
        flight.results[shard.index] = result
        flight.round_trips[shard.index] = time.perf_counter() - submitted
        flight.idle.append(index)

    def _expire(self, flight: _Flight) -> None:
        """Replace the workers that held a shard past `--rollout-timeout`, and sample their shards again."""
        now_s = time.perf_counter()
        for ref, (index, shard, submitted) in list(flight.running.items()):
            if now_s - submitted > self.timeout:
                flight.running.pop(ref)
                self._retry(index, shard, flight.pending, flight.failures,
                            f"no answer in {self.timeout:g} s (--rollout-timeout)")
                flight.idle.append(index)
                flight.retries += 1
                flight.timeouts += 1

    def _retry(self, index: int, shard: Shard, pending: collections.deque, failures: collections.Counter,
               reason: str) -> None:
        """Replace worker `index` and put `shard` back at the front of the queue."""
        failures[shard.index] += 1
        if failures[shard.index] >= MAX_SHARD_ATTEMPTS:
            raise RuntimeError(f"rollout shard {shard.index} failed on {MAX_SHARD_ATTEMPTS} workers in a row "
                               f"(last: {reason}); see the workers' logs under /tmp/ray/session_latest/logs")
        log.warning("rollout worker %d: %s; replacing it and sampling shard %d again", index, reason, shard.index)
        self.ray.kill(self.workers[index], no_restart=True)
        self._start(index)
        pending.appendleft(shard)

    def close(self) -> None:
        for worker in self.workers:
            self.ray.kill(worker, no_restart=True)
        self.workers = []
        if self.owns_ray:
            self.ray.shutdown()
