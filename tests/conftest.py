"""Shared fixtures: tiny random models the tests build themselves (nothing is downloaded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from sparserl.model.loading import builtin_model_config
from sparserl.tasks.tokenizer import build_char_tokenizer

torch.set_num_threads(1)


def make_tiny_model(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, object]:
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    settings.update(overrides)
    model = LlamaForCausalLM(builtin_model_config(len(tokenizer), **settings)).eval()
    return model, tokenizer


def make_tiny_gemma3(layer_types: list[str], sliding_window: int):
    """A 4-layer Gemma-3 style hybrid (vocabulary 97): sliding-window layers beside full-attention ones."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=sliding_window,
                              layer_types=layer_types, max_position_embeddings=256, pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama + char tokenizer saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = make_tiny_model()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def replay_logprobs(model, batch, rows=None) -> torch.Tensor:
    """Sparse-sampler log-probs `[n, T]` of `batch`'s responses, rebuilt by one forward under the
    replay masks: what every exact-replay test compares with the recorded ones."""
    from sparserl.model.forward import response_logprobs
    from sparserl.rollout.sparsity.replay import replay_attention

    rows = slice(None) if rows is None else rows
    with replay_attention(model, batch, rows):
        logprobs, _ = response_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows],
                                        batch.prompt_ids.shape[1])
    return logprobs


def kill_part_way_then_resume(argv: list[str], out, steps: int, lines: int) -> int:
    """Run `sparserl` with `argv` in a subprocess, SIGKILL it once its metrics hold `lines` records,
    then resume it in this process to `steps`. Returns the steps the killed run had logged."""
    from sparserl.cli import main
    from sparserl.train.metrics import read_metrics

    process = subprocess.Popen([sys.executable, "-m", "sparserl.cli", *argv],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(out / "metrics.jsonl")) < lines:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done = len(read_metrics(out / "metrics.jsonl")) - 1
    assert 0 < done < steps, "the run should have been killed part-way"
    assert main([*argv, "--resume"]) == 0
    return done


def without_host_reads(monkeypatch) -> None:
    """Turn off the CPU-only shortcuts that read a value back to the host (`host_reads_are_cheap`), wherever a
    module imported it, so a rollout on the CPU takes the GPU's path."""
    import sparserl.rollout.sparsity.policies  # noqa: F401 - every policy module, imported
    for name, module in list(sys.modules.items()):
        if name.startswith("sparserl.") and hasattr(module, "host_reads_are_cheap"):
            monkeypatch.setattr(module, "host_reads_are_cheap", lambda tensor: False)
