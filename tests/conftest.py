"""Shared fixtures: tiny random models the tests build themselves (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from sparserl.models import builtin_model_config
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama + char tokenizer saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = make_tiny_model()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
