"""TRL with sparse rollouts on two processes (`accelerate launch --multi_gpu --num_processes 2` with
`GRPOConfig(use_cpu=True)`: gloo on CPU): rows draw distinct seeds across processes and generation batches; the
step trains as one process holding the same rows (completions, corrections, logged figures, the weights' update);
the corrections are `compute_corrections` over both processes' rows; and the sampler's KV and speculation figures
are merged over processes by `KVStats.merged`'s rule, not averaged.

Slow (three processes that each import TRL: about a minute of CPU): `pytest -m slow tests/test_trl_processes.py`.
On a CPU, accelerate starts several processes only with `--multi_gpu` and `use_cpu=True`; `--cpu --num_processes
2` starts one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from sparserl.config.presets import load_preset
from sparserl.learner.corrections import compute_corrections
from sparserl.model.forward import response_logprobs

pytestmark = pytest.mark.slow
RUN = Path(__file__).parent / "trl_processes_run.py"
SAMPLERS = ("sparse", "speculative")
# The figures that are per sampler, not per row: memory (KVStats.merged keeps the largest process's, where one
# process holding every row holds more), event counts that add up over samplers, and clocks.
PER_SAMPLER = {"sparserl/kv_peak_bytes", "sparserl/kv_dense_bytes", "sparserl/rows_in_flight",
               "sparserl/rollout_waves", "sparserl/kv_compressions", "sparserl/kv_compress_time_frac",
               "sparserl/rollout_s", "step_time", "train_runtime", "train_samples_per_second",
               "train_steps_per_second"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same step run on two processes of 4 rows a generation batch, and on one of 8; their records."""
    root = tmp_path_factory.mktemp("trl_processes")
    model, _ = make_tiny_model(seed=7)
    model.save_pretrained(root / "model")
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
          str(_free_port()), str(RUN), "--model", str(root / "model"), "--out", str(root / "two"), "--rows", "4"])
    _run([sys.executable, str(RUN), "--model", str(root / "model"), "--out", str(root / "one"), "--rows", "8"])

    def load(path):
        return torch.load(path, weights_only=False)

    return {"model": model,
            "two": {s: [load(root / "two" / f"{s}-rank{r}.pt") for r in (0, 1)] for s in SAMPLERS},
            "one": {s: load(root / "one" / f"{s}-rank0.pt") for s in SAMPLERS},
            "two_figures": {s: load(root / "two" / f"{s}-figures.pt") for s in SAMPLERS},
            "one_figures": {s: load(root / "one" / f"{s}-figures.pt") for s in SAMPLERS}}


def _padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """`[B, T_i]` tensors right-padded with 0 to `width` columns and stacked by rows."""
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def _both_processes(records: list[dict], batch: int, key: str, width: int) -> torch.Tensor:
    """Generation batch `batch`'s `key` of process 0's rows then process 1's (TRL's order of the whole batch)."""
    return _padded([r["after"][batch][key] for r in records], width)


def _completions(after: dict) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(after["completion_ids"], after["completion_mask"])]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_row_of_a_step_draws_its_own_seed_and_one_process_draws_the_same(runs, sampler):
    """Every prompt is the same, so rows sharing a seed would share a completion: the seeds of the step's 16 rows
    (2 processes x 2 generation batches x 4) are distinct, the 4 blocks' completions differ, and the one-process
    run draws, row for row, the seeds of the two processes' rows in TRL's order."""
    two, one = runs["two"][sampler], runs["one"][sampler]
    seeds = [seed for record in two for batch in record["seeds"] for seed in batch]
    assert len(seeds) == 16 and len(set(seeds)) == 16
    blocks = [_completions(record["after"][batch]) for record in two for batch in (0, 1)]
    assert all(blocks[i] != blocks[j] for i in range(4) for j in range(i + 1, 4))
    assert one["seeds"] == [two[0]["seeds"][batch] + two[1]["seeds"][batch] for batch in (0, 1)]


def test_two_processes_train_as_one_process_holding_the_same_rows(runs):
    """R-KV rollouts under sparse-rl (batch-normalised weights, a veto) with a KL term: the same completions, the
    same corrected advantages and kept tokens, every logged figure but the per-sampler ones, and the same update
    of the weights (plain SGD: the step's gradient), to float rounding."""
    two, one = runs["two"]["sparse"], runs["one"]["sparse"]
    for batch in (0, 1):
        alone = one["after"][batch]
        width = max(alone["completion_ids"].shape[1], *(r["after"][batch]["completion_ids"].shape[1] for r in two))
        assert _completions(alone) == _completions(two[0]["after"][batch]) + _completions(two[1]["after"][batch])
        for key in ("advantages", "tool_mask"):
            torch.testing.assert_close(_both_processes(two, batch, key, width), _padded([alone[key]], width),
                                       rtol=1e-5, atol=1e-6)
    logged_two, logged_one = runs["two_figures"]["sparse"]["log"][0], runs["one_figures"]["sparse"]["log"][0]
    assert set(logged_two) == set(logged_one) and "sparserl/is_batch_norm_factor" in logged_two
    for key in set(logged_two) - PER_SAMPLER:
        assert logged_two[key] == pytest.approx(logged_one[key], rel=1e-5, abs=1e-7), key
    assert logged_two["kl"] > 1e-4
    initial = runs["two_figures"]["sparse"]["initial"]
    assert all(torch.equal(initial[k], runs["one_figures"]["sparse"]["initial"][k]) for k in initial)
    after_two, after_one = runs["two_figures"]["sparse"]["weights"], runs["one_figures"]["sparse"]["weights"]
    moved = sum(float((after_one[k] - initial[k]).abs().sum()) for k in initial)
    assert moved > 1e-2
    for key in initial:
        torch.testing.assert_close(after_two[key] - initial[key], after_one[key] - initial[key], rtol=1e-4,
                                   atol=1e-7)


def test_the_corrections_are_compute_corrections_over_both_processes_rows(runs):
    """π_old by sparserl's own forward of the initial weights (the step's two generation batches precede its update)
    on both processes' rows: the kept tokens and the weights TRL trained with are `compute_corrections`' of the
    whole batch, whose batch normalisation differs from either process's alone."""
    two, model = runs["two"]["sparse"], runs["model"]
    model.load_state_dict(runs["two_figures"]["sparse"]["initial"])
    config = load_preset("sparse-rl").correction
    assert config.batch_normalize
    for batch in (0, 1):
        width = max(r["after"][batch]["completion_ids"].shape[1] for r in two)
        mask = _both_processes(two, batch, "completion_mask", width)
        prompts = torch.cat([r["after"][batch]["prompt_ids"] for r in two])
        prompt_mask = torch.cat([r["after"][batch]["prompt_mask"] for r in two])
        ids = torch.cat([prompts, _both_processes(two, batch, "completion_ids", width)], dim=1)
        with torch.no_grad():
            old, _ = response_logprobs(model, ids, torch.cat([prompt_mask, mask], dim=1), prompts.shape[1])
        sampler = _both_processes(two, batch, "sampling_per_token_logps", width)
        expected = compute_corrections(old.double(), sampler.double(), mask, config)
        assert torch.equal(_both_processes(two, batch, "tool_mask", width), (mask * expected.keep_mask).float())
        advantages = torch.cat([r["before"][batch]["advantages"] for r in two])
        torch.testing.assert_close(_both_processes(two, batch, "advantages", width).double(),
                                   advantages[:, None].double() * expected.weights, rtol=1e-5, atol=1e-6)
        own = compute_corrections(old[:4].double(), sampler[:4].double(), mask[:4], config)
        assert abs(own.metrics["is_batch_norm_factor"] - expected.metrics["is_batch_norm_factor"]) > 1e-5


def test_the_samplers_figures_are_merged_over_processes(runs):
    """Per-row figures and α are pooled over both processes' rows, speculation counts summed before their ratios are
    taken, and memory is per sampler: the logged peak is the larger process's (TRL logs the mean over a step's two
    generation batches)."""
    def over_batches(figure) -> float:
        return sum(figure(batch) for batch in (0, 1)) / 2

    two, logged = runs["two"]["sparse"], runs["two_figures"]["sparse"]["log"][0]
    assert logged["sparserl/kv_peak_bytes"] == over_batches(lambda b: max(r["kv"][b]["peak"] for r in two))
    assert logged["sparserl/kv_compressions"] == over_batches(lambda b: sum(r["kv"][b]["compressions"] for r in two))
    assert logged["sparserl/kv_kept_tokens_mean"] == pytest.approx(over_batches(
        lambda b: float(torch.cat([r["kv"][b]["kept"] for r in two]).mean())), rel=1e-6)
    assert logged["sparserl/alpha_mean"] == pytest.approx(over_batches(
        lambda b: float(torch.cat([r["alpha"][b] for r in two]).mean())), rel=1e-6)
    kept_frac = over_batches(lambda b: float(sum(r["kv"][b]["kept"].sum() for r in two) / sum(
        (r["kv"][b]["kept"] + r["kv"][b]["evicted"]).sum() for r in two)))
    assert logged["sparserl/kv_kept_frac"] == pytest.approx(kept_frac, rel=1e-6)

    two, logged = runs["two"]["speculative"], runs["two_figures"]["speculative"]["log"][0]

    def pooled(numerator: str, denominator: str):
        return over_batches(lambda b: sum(r["speculation"][b][numerator] for r in two) /
                            sum(r["speculation"][b][denominator] for r in two))

    assert logged["sparserl/spec_acceptance_rate"] == pytest.approx(pooled("accepted", "compared"), rel=1e-9)
    assert logged["sparserl/spec_tokens_per_verification"] == pytest.approx(pooled("tokens", "verifications"),
                                                                           rel=1e-9)
