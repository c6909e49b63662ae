"""Every model family the README promises, through the rollout engine: tiny random Llama, Qwen2, Qwen3, Mistral,
Phi-3, OLMo-2, Gemma-2 (attention and final logit soft-capping, sliding-window layers beside full ones,
query_pre_attn_scalar) and Gemma-3, each built here from its transformers config. For each, over prompts of
different lengths (left padding): the dense engine's greedy tokens are `generate`'s, the sampler's log-probs are
teacher forcing's, and an R-KV rollout whose budget binds replays exactly."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FAMILY_BOS, FAMILY_CASES, FAMILY_EOS, FAMILY_GEMMA2, FAMILY_PAD, make_family, replay_logprobs

from sparserl.model.forward import response_logprobs
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

PAD, BOS, EOS = FAMILY_PAD, FAMILY_BOS, FAMILY_EOS
NEW_TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(EOS + 1, 97) for _ in range(length)] for length in (9, 4, 12, 7)]


def _tolerance(model) -> float:
    """Both sides record float32 log-probs. A float64 model's come out equal bit for bit (measured: 0 apart
    in every family), and 1e-10, below float32's spacing at any log-prob under -0.001, asks for that. A float32
    model's (Gemma-2) differ by rounding in batched products (~2e-6 measured): 1e-5, as in test_engine.py."""
    return 1e-10 if next(model.parameters()).dtype == torch.float64 else 1e-5


def _greedy_is_generate(model) -> None:
    prompts = _prompts()
    greedy = RolloutEngine(model).generate(prompts, SamplingConfig(NEW_TOKENS, 0.0, eos_token_id=None,
                                                                   pad_token_id=PAD))
    # EOS off on both sides: `generate` stops at (and pads after) the configured EOS.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = model.generate(greedy.prompt_ids, attention_mask=greedy.prompt_mask.long(),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    assert torch.equal(greedy.response_ids, expected[:, greedy.prompt_ids.shape[1]:])


def _sampler_is_teacher_forcing(model) -> None:
    sampling = SamplingConfig(NEW_TOKENS, 1.0, eos_token_id=EOS, pad_token_id=PAD)
    batch = RolloutEngine(model).generate(_prompts(), sampling, seeds=[11, 12, 13, 14])
    with torch.no_grad():
        reference, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1])
    mask = batch.response_mask.bool()
    assert mask.sum() > 40
    assert (batch.sampler_logprobs - reference).abs()[mask].max() <= _tolerance(model)


def _rkv_replays_exactly(model) -> None:
    compression = KVCompression("rkv", budget=8, window=3, interval=3)
    sampling = SamplingConfig(NEW_TOKENS, 1.0, eos_token_id=None, pad_token_id=PAD)
    batch = RolloutEngine(model, compression).generate(_prompts(), sampling, seeds=[21, 22, 23, 24])
    assert batch.kv.compressions >= 3
    mask = batch.response_mask.bool()
    with torch.no_grad():
        replayed = replay_logprobs(model, batch)
        dense, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1])
    assert (replayed - batch.sampler_logprobs).abs()[mask].max() <= _tolerance(model)
    assert (dense - batch.sampler_logprobs).abs()[mask].max() > 1e-2  # eviction did change the sampler


@pytest.mark.parametrize(("family", "overrides"), FAMILY_CASES)
def test_a_family_samples_as_transformers_and_replays_exactly(family, overrides):
    model = make_family(family, overrides)
    _greedy_is_generate(model)
    _sampler_is_teacher_forcing(model)
    _rkv_replays_exactly(model)


def test_the_caps_bite():
    """Without either of its soft-cappings the tiny Gemma-2 (the same weights) gives other log-probs, so the family
    test could not pass with a cap ignored."""
    ids = torch.tensor([_prompts()[2]])

    def logprobs(**caps):
        with torch.no_grad():
            return make_family("Gemma2", {**FAMILY_GEMMA2, **caps})(ids).logits.log_softmax(-1)

    both, final_only = logprobs(), logprobs(attn_logit_softcapping=None)
    neither = logprobs(attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (both - final_only).abs().max() > 0.1
    assert (final_only - neither).abs().max() > 0.1
