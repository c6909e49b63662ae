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


# Tiny random models of every family the engine supports (tests/test_model_families.py, test_shared_prompt.py).
FAMILY_PAD, FAMILY_BOS, FAMILY_EOS = 0, 1, 3
# Larger than transformers' 0.02, so that attention is peaked: Gemma-2's caps then bite and masks matter.
_FAMILY_INIT = 0.2
_FAMILY_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=_FAMILY_INIT,
                      pad_token_id=FAMILY_PAD, bos_token_id=FAMILY_BOS, eos_token_id=FAMILY_EOS)
# Sliding and full layers in turn, a scale other than 1/√D, and caps below the real 50 and 30 so that they bite.
FAMILY_GEMMA2 = dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                     attn_logit_softcapping=10.0, final_logit_softcapping=5.0)
# family -> config overrides (None: the Gemma-3 hybrid); the classes are transformers' `<family>Config` and
# `<family>ForCausalLM`.
FAMILIES = {
    "Llama": {},
    "Qwen2": {},
    "Qwen3": dict(head_dim=16),
    "Mistral": dict(head_dim=16),  # its default window of 4096 never binds here: see the -sliding case
    "Phi3": {},
    "Olmo2": {},
    "Gemma2": FAMILY_GEMMA2,
    "Gemma3": None,
}
# Mistral and Phi-3 with a window that binds (Phi-3-mini-4k's is 2047 tokens): transformers applies a
# `sliding_window` without `layer_types` to every layer, and so must the cache and the replay.
FAMILY_CASES = [pytest.param(family, FAMILIES[family], id=family) for family in FAMILIES] + [
    pytest.param(family, dict(FAMILIES[family], sliding_window=6), id=f"{family}-sliding")
    for family in ("Mistral", "Phi3")]


def make_family(family: str, overrides: dict | None):
    """The tiny random model, float64 except Gemma-2: transformers runs Gemma-2 with its eager attention only,
    which softmaxes in float32, and there a float64 mask's minimum becomes -inf, so every left-padded row's
    forward is NaN."""
    import transformers

    if overrides is None:
        return make_tiny_gemma3(["sliding_attention", "full_attention"] * 2, sliding_window=5).double()
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**_FAMILY_COMMON, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    return model if family == "Gemma2" else model.double()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama + char tokenizer saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = make_tiny_model()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def replay_logprobs(model, batch, rows=None, share_prompts: bool = False) -> torch.Tensor:
    """Sparse-sampler log-probs `[n, T]` of `batch`'s responses, rebuilt by one forward under the
    replay masks: what every exact-replay test compares with the recorded ones."""
    from sparserl.model.forward import hidden_logprobs, response_hidden
    from sparserl.rollout.sparsity.replay import sampler_replay

    rows = slice(None) if rows is None else rows
    ids, width = batch.input_ids[rows], batch.prompt_ids.shape[1]
    hidden = response_hidden(model, ids, batch.attention_mask[rows], width, share_prompts,
                             masks=sampler_replay(model, batch, rows))
    return hidden_logprobs(model, hidden, ids[:, width:])[0]


WRITE_SLOTS = (3, 5, 0, 9)  # the slot each of `static_write_layer`'s four rows writes its token into


def static_write_layer(kv_format=None):
    """A cache layer of 4 rows x 2 KV heads x 1024 slots (head dim 8, float32) set up for one static-step write: row r
    writes its token into slot WRITE_SLOTS[r], at column 7 + r. `kv_format`: stored quantized (its scales are the
    caller's to set)."""
    from sparserl.rollout.cache import BufferLayer

    layer = BufferLayer(4, 2, 8, 1024, 2, torch.float32, torch.device("cpu"), growth=1024, kv_format=kv_format)
    layer.reserve(1024)
    layer.static_rows, layer.static_slots = torch.arange(4)[:, None], torch.tensor(WRITE_SLOTS)[:, None]
    layer.incoming_columns, layer.incoming_real = torch.arange(7, 11)[:, None], torch.ones(4, 1, dtype=torch.bool)
    return layer


def compiled_static_write(layer) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Random keys and values `[4, 2, 1, 8]` written by `layer`'s static write compiled with Inductor, and the shapes
    of the tensors the generated code allocates (a buffer's shape among them: the write copied the cache)."""
    import re

    from torch._inductor.utils import run_and_get_code

    keys, values = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)

    def write(keys, values):
        written = layer._write_static(keys, values)
        return written[0].sum(), written[1].sum()

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(write, fullgraph=True), keys, values)
    torch._dynamo.reset()
    return keys, values, re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code[0])


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
