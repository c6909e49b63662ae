"""Chunked log-probs: the same values and gradients as full logits, without holding [N, T, V]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from sparserl.model import forward
from sparserl.model.forward import response_logprobs
from sparserl.model.structure import positions_from_mask

SCRIPT = Path(__file__).parent / "data" / "large_vocab_step.py"
RSS_BOUND_MIB = 1500


def _plain(model, ids, mask, width):
    """Full logits over the whole batch, as the model's own forward gives them."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    log_probs = torch.log_softmax(logits[:, width - 1:-1].float(), dim=-1)
    token = log_probs.gather(2, ids[:, width:, None]).squeeze(-1)
    return token, -(log_probs.exp() * log_probs).sum(-1)


def test_chunks_give_the_plain_values_and_gradients(monkeypatch):
    model, _ = make_tiny_model()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (5, 30), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    width = 12
    monkeypatch.setattr(forward, "LOGIT_CHUNK_BYTES", 5 * 97 * 4 * 3)  # 3 positions per chunk: 6 chunks
    assert len(forward.position_chunks(5, 18, 97)) == 6
    token, entropy = response_logprobs(model, ids, mask, width, with_entropy=True)
    (token.sum() + entropy.sum()).backward()
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain_token, plain_entropy = _plain(model, ids, mask, width)
    (plain_token.sum() + plain_entropy.sum()).backward()
    assert (token - plain_token).abs().max() < 1e-5 and (entropy - plain_entropy).abs().max() < 1e-5
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], parameter.grad, rtol=1e-4, atol=1e-6)


def _peak_rss_mib(*modes: str) -> list[int]:
    """Each mode's peak RSS, the processes run side by side (each its own peak: `ru_maxrss` is per process)."""
    processes = [subprocess.Popen([sys.executable, str(SCRIPT), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for mode in modes]
    peaks = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=600)
            assert process.returncode == 0, err[-2000:]
            peaks.append(int(out.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return peaks


@pytest.mark.slow  # 120 s; the chunked log-probs' values are checked on small vocabularies above
def test_a_128k_vocabulary_update_and_alpha_stay_within_memory():
    # 8 × 512 response tokens × 128k float32 logits are 2 GB by themselves; the unchunked path
    # holds several such tensors (≈ 6.4 GB measured), the chunked one one chunk at a time (≈ 0.65 GB).
    # α compares two such distributions (dense and replayed sampler) under the same chunking.
    chunked, unchunked = _peak_rss_mib("chunked", "unchunked")
    assert chunked < RSS_BOUND_MIB
    assert unchunked > RSS_BOUND_MIB, "the bound no longer separates the two paths"


def test_logprobs_at_a_temperature_are_those_of_the_tempered_distribution():
    """What a sampler at T draws from is softmax(logits / T): the learner's log-probs and entropy are
    of that distribution (else a dense rollout at T = 0.7 looks off-policy to every correction)."""
    model, _ = make_tiny_model()
    ids = torch.randint(3, 90, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    width = 8
    with torch.no_grad():
        token, entropy = response_logprobs(model, ids, mask, width, with_entropy=True, temperature=0.7)
        greedy, _ = response_logprobs(model, ids, mask, width, temperature=0.0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    for scale, got in ((0.7, token), (1.0, greedy)):  # greedy samplers record the plain softmax
        reference = torch.log_softmax(logits[:, width - 1:-1].double() / scale, dim=-1)
        assert (got.double() - reference.gather(2, ids[:, width:, None]).squeeze(-1)).abs().max() < 1e-5
    reference = torch.log_softmax(logits[:, width - 1:-1].double() / 0.7, dim=-1)
    assert (entropy.double() + (reference.exp() * reference).sum(-1)).abs().max() < 1e-5
