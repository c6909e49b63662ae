"""Shared-prompt forwards (`model/shared_prompt.py`) against the plain forward over every row: the same hidden
states, log-probs and gradients of every parameter, in float64 to 1e-10, for every model family the engine
supports, with prompts of different lengths in one batch, groups of different sizes, rows without a partner,
micro-batches that cut a group, and the exact replay of a sparse sampler."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FAMILY_CASES, make_family, make_tiny_model, replay_logprobs

from sparserl.model.forward import hidden_logprobs, micro_batches, response_hidden, response_logprobs
from sparserl.model.shared_prompt import causal_masks, prompt_groups, shared_prompt_hidden
from sparserl.model.structure import layer_windows, text_config
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

PAD = 0
# Groups of 3, 1, 4 and 2 rows; prompts of 9, 4, 12 and 7 tokens; responses of 1 to 8 tokens.
GROUP_SIZES = (3, 1, 4, 2)


def _exact_norms(model) -> None:
    """transformers' RMSNorms compute in float32 whatever the model's dtype, so their backward rounds the summed
    gradients of a group's rows to float32: the same arithmetic in the model's own dtype (each family's formula:
    Gemma's scales by 1 + weight) lets a float64 comparison see float64 differences."""
    def exact(norm):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        gemma = type(norm).__name__.startswith("Gemma")

        def forward(hidden):
            scaled = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
            return scaled * (1.0 + norm.weight) if gemma else norm.weight * scaled
        return forward

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = exact(module)


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts, right-padded responses `[N, P + T]`, group by group (GROUP_SIZES)."""
    rng = random.Random(seed)
    width, span = 12, 8
    rows = []
    for size, length in zip(GROUP_SIZES, (9, 4, 12, 7)):
        prompt = [rng.randrange(4, vocab) for _ in range(length)]
        rows += [(prompt, [rng.randrange(4, vocab) for _ in range(rng.randint(1, span))]) for _ in range(size)]
    ids = torch.full((len(rows), width + span), PAD)
    mask = torch.zeros_like(ids)
    for row, (prompt, response) in enumerate(rows):
        ids[row, width - len(prompt):width], ids[row, width:width + len(response)] = torch.tensor(prompt), \
            torch.tensor(response)
        mask[row, width - len(prompt):width + len(response)] = 1
    return ids, mask, width


def _loss_and_grads(model, ids, mask, width, share: bool, micro_batch: int, our_attention: bool = False):
    """Log-probs `[N, T]` and every parameter's gradient of a loss over the real response tokens, summed over
    micro-batches of `micro_batch` rows (one backward each, as the update does). `our_attention`: the plain
    forward under the package's attention with `causal_masks` (for Gemma-2, whose transformers attention cannot
    run in float64), else transformers' own."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) for p in parameters]
    logprobs = []
    weights = torch.linspace(0.5, 1.5, ids.shape[1] - width, dtype=torch.float64)
    for rows in micro_batches(len(ids), micro_batch):
        masks = causal_masks(mask[rows], layer_windows(text_config(model))) if our_attention else None
        hidden = response_hidden(model, ids[rows], mask[rows], width, share_prompts=share, masks=masks)
        logp, _ = hidden_logprobs(model, hidden, ids[rows, width:])
        loss = -(logp.double() * weights * mask[rows, width:]).sum()
        for total, part in zip(grads, torch.autograd.grad(loss, parameters)):
            total += part
        logprobs.append(logp.detach())
    return torch.cat(logprobs), grads


def test_groups_are_runs_of_equal_prompts():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 5, 6], [0, 5, 6], [0, 5, 6]])
    mask = (ids != 0).long()
    group, first = prompt_groups(ids, mask)
    assert group.tolist() == [0, 0, 1, 2, 2] and first.tolist() == [0, 2, 3]
    # Equal ids but different padding is another prompt.
    group, _ = prompt_groups(ids[:2], torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert group.tolist() == [0, 1]


@pytest.mark.parametrize(("family", "overrides"), FAMILY_CASES)
def test_shared_prompts_give_the_plain_forwards_log_probs_and_gradients(family, overrides):
    model = make_family(family, overrides).double().train()
    _exact_norms(model)
    ids, mask, width = _batch(model.config.vocab_size)
    plain_logp, plain_grads = _loss_and_grads(model, ids, mask, width, share=False, micro_batch=len(ids),
                                              our_attention=family == "Gemma2")
    real = mask[:, width:].bool()
    # Micro-batches of 4 cut the groups of 3 and 4 rows.
    for micro_batch in (len(ids), 4):
        logp, grads = _loss_and_grads(model, ids, mask, width, share=True, micro_batch=micro_batch)
        assert (logp - plain_logp).abs()[real].max() <= 1e-10
        worst = max(float((g - p).abs().max()) for g, p in zip(grads, plain_grads))
        assert worst <= 1e-10, f"{family}: gradients {worst:.1e} apart"
    assert max(float(g.abs().max()) for g in plain_grads) > 1e-3  # the comparison compared something


def test_the_causal_masks_are_what_one_forward_sees():
    """Under `causal_masks` our attention over the whole sequence is transformers' own forward (float64)."""
    model = make_family("Mistral", {"sliding_window": 6}).double()
    ids, mask, width = _batch(model.config.vocab_size)
    plain = response_hidden(model, ids, mask, width)
    masks = causal_masks(mask, layer_windows(text_config(model)))
    ours = response_hidden(model, ids, mask, width, masks=masks)
    assert (ours - plain)[mask[:, width - 1:-1].bool()].abs().max() <= 1e-12


@pytest.mark.parametrize("policy", ["rkv", "snapkv"])
def test_the_replay_shares_prompts_exactly(policy):
    """The sparse sampler's replay, each group's prompt computed once, reproduces the sampler's log-probs as the
    plain replay does; per-head selection too (the masks then differ per KV head)."""
    model, tokenizer = make_tiny_model(seed=4)
    model = model.double()
    prompts = [p for length, size in zip((9, 4, 12), (3, 2, 4)) for p in [list(range(5, 5 + length))] * size]
    compression = KVCompression(policy, budget=8, window=3, interval=3, per_head=policy == "snapkv")
    batch = RolloutEngine(model, compression).generate(
        prompts, SamplingConfig(20, 1.0, eos_token_id=None, pad_token_id=tokenizer.pad_token_id),
        seeds=list(range(len(prompts))))
    assert batch.kv.compressions >= 3
    real = batch.response_mask.bool()
    with torch.no_grad():
        shared, plain = replay_logprobs(model, batch, share_prompts=True), replay_logprobs(model, batch)
    assert (shared - plain).abs()[real].max() <= 1e-10
    assert (shared - batch.sampler_logprobs).abs()[real].max() <= 1e-6


def test_float32_agreement_on_the_built_in_model():
    """In float32 the two parts round differently from one forward: at most 7.2e-6 apart on log-probs over five
    such batches of the shipped model (2026-11-25)."""
    from sparserl.model.loading import load_policy

    model, _ = load_policy(None)
    ids, mask, width = _batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        plain = hidden_logprobs(model, response_hidden(model, ids, mask, width), ids[:, width:])[0]
        shared = hidden_logprobs(model, shared_prompt_hidden(model, ids, mask, width), ids[:, width:])[0]
    assert (plain - shared).abs()[mask[:, width:].bool()].max() <= 2e-5


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of `run()`."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


@pytest.mark.parametrize(("prompt", "response"), [(16, 64), (256, 256), (64, 1024), (1024, 1024), (512, 2048),
                                                  (256, 4096), (1024, 4096)])
def test_sharing_prompts_keeps_no_more_for_the_backward_than_the_plain_forward(prompt, response):
    """Saved-for-backward bytes of a training forward (one layer, 6 query heads on 2 KV heads as SmolLM2's 9 on 3,
    two groups of two rows, left padding), shared against plain, up to prompt 1k / response 4k: the shared forward
    keeps its masks as [N, 1, T, S], not expanded over each query group ([N, Hkv, G·T, S] kept 1.4-1.8x the plain
    forward's bytes at these shapes)."""
    model, _ = make_tiny_model(hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                               num_key_value_heads=2)
    model.train()
    generator = torch.Generator().manual_seed(prompt + response)
    ids = torch.randint(4, 20, (4, prompt + response), generator=generator)
    ids[1, :prompt], ids[3, :prompt] = ids[0, :prompt], ids[2, :prompt]
    mask = torch.ones_like(ids)
    mask[2:, :3] = 0
    saved = {share: _saved_bytes(lambda: response_logprobs(model, ids, mask, prompt, share_prompts=share)[0].sum())
             for share in (False, True)}
    assert saved[True] <= saved[False]


def test_a_rope_that_depends_on_the_length_falls_back_to_the_plain_forward():
    """Dynamic NTK RoPE recomputes its frequencies from the longest position of the forward: a prompt-only forward
    rotates the prompt otherwise than the whole sequence's does (0.24 apart in float64 on a Phi-3-128k shape), so
    such a model computes every row's prompt again, and gets the plain forward's log-probs."""
    model, _ = make_tiny_model(seed=3, max_position_embeddings=14, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    model = model.double()
    ids, mask, width = _batch(model.config.vocab_size)
    with torch.no_grad():
        plain = response_logprobs(model, ids, mask, width)[0]
        shared = response_logprobs(model, ids, mask, width, share_prompts=True)[0]
        two_parts = hidden_logprobs(model, shared_prompt_hidden(model, ids, mask, width), ids[:, width:])[0]
    real = mask[:, width:].bool()
    assert (shared - plain).abs()[real].max() <= 1e-12
    assert (two_parts - plain).abs()[real].max() > 1e-6  # what sharing would have cost: the fallback matters
