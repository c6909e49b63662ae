"""The learner through the sampler's attention (`--mode sparse-learner`): π_old is the sampler's own policy, checked
against the recorded log-probs and against a hand-written float64 forward under hand-built masks; the update's
gradient is that forward's; what cannot run is refused in one line; a run trains, logs, checkpoints and resumes."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file

from sparserl.cli import main
from sparserl.config.schema import load_config
from sparserl.errors import ConfigError
from sparserl.learner.sampler_forward import SamplerForward
from sparserl.learner.update import ppo_update
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.tasks.pointer_walk import PointerWalkTask
from sparserl.train.metrics import read_metrics
from sparserl.train.trainer import GRPOTrainer

TIMING_KEYS = {"rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac"}
SMALL_CACHE = {"kv_budget": 10, "kv_window": 3, "kv_interval": 3}


# ---------------------------------------------------------------- an independent forward
def hand_masks(batch, num_layers: int) -> list[torch.Tensor]:
    """Per layer, bool `[N, Hs, S, S]`: query column q sees key column c when c is a real token, c <= q, and the
    layer's cache held c at q (no compression yet before q, or c kept by the last compression at or before q, or c fed
    since it); and always itself. Built from the eviction record alone, query by query."""
    real = batch.attention_mask.bool()
    rows, width = real.shape
    masks = []
    for layer in range(num_layers):
        events = sorted((e for e in batch.evictions if e.layer == layer), key=lambda e: e.first_column)
        heads = events[0].kept_columns.shape[1] if events else 1
        mask = torch.zeros(rows, heads, width, width, dtype=torch.bool)
        for q in range(width):
            earlier = [e for e in events if e.first_column <= q]
            for row in range(rows):
                for head in range(heads):
                    if earlier:
                        last = earlier[-1]
                        held = set(last.kept_columns[row, head].tolist()) | set(range(last.first_column, q + 1))
                    else:
                        held = set(range(q + 1))
                    for c in held:
                        if c <= q and real[row, c]:
                            mask[row, head, q, c] = True
                    mask[row, head, q, q] = True
        masks.append(mask)
    return masks


def hand_logprobs(model, batch, masks, temperature: float = 1.0, dtype=torch.float64):
    """Log-probs and entropies `[N, T]` of `batch`'s responses by a Llama forward written out here (RMSNorm, RoPE at
    the real-token positions, grouped-query attention under `masks`, SwiGLU, tied head), in `dtype`, differentiable in
    the model's parameters. Only the RoPE table is taken as transformers computes it (in float32)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    eps = config.rms_norm_eps

    def weight(module):
        return module.weight.to(dtype)

    def norm(x, module):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight(module)

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    ids, real = batch.input_ids, batch.attention_mask.bool()
    rows, width = ids.shape
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    rotary = model.model.rotary_emb
    freqs = positions[..., None].float() * rotary.inv_freq.float()
    angles = torch.cat([freqs, freqs], dim=-1)
    cos = (angles.cos() * rotary.attention_scaling).to(dtype)[:, None]
    sin = (angles.sin() * rotary.attention_scaling).to(dtype)[:, None]
    embedding = model.model.embed_tokens  # its padding row takes no gradient from the lookup, as in nn.Embedding
    x = torch.nn.functional.embedding(ids, weight(embedding), padding_idx=embedding.padding_idx)
    for layer, block in enumerate(model.model.layers):
        attention = block.self_attn
        h = norm(x, block.input_layernorm)
        q = (h @ weight(attention.q_proj).T).view(rows, width, heads, dim).transpose(1, 2)
        k = (h @ weight(attention.k_proj).T).view(rows, width, kv_heads, dim).transpose(1, 2)
        v = (h @ weight(attention.v_proj).T).view(rows, width, kv_heads, dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        seen = masks[layer]
        seen = seen.repeat_interleave(heads // kv_heads, dim=1) if seen.shape[1] == kv_heads > 1 else seen
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dim)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(rows, width, heads * dim)
        x = x + out @ weight(attention.o_proj).T
        h = norm(x, block.post_attention_layernorm)
        mlp = block.mlp
        x = x + (torch.nn.functional.silu(h @ weight(mlp.gate_proj).T) * (h @ weight(mlp.up_proj).T)) \
            @ weight(mlp.down_proj).T
    prompt = batch.prompt_ids.shape[1]
    logits = norm(x, model.model.norm)[:, prompt - 1:-1] @ weight(model.get_output_embeddings()).T
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    token = log_probs.gather(2, ids[:, prompt:, None]).squeeze(-1)
    return token, -(log_probs.exp() * log_probs).sum(-1)


# ---------------------------------------------------------------- π_old is the sampler's
def _trainer(model_dir, out, **settings):
    # A random model earns no reward; the entropy bonus gives every step a real gradient.
    common = dict(model=str(model_dir), out=str(out), mode="sparse-learner", log_with="none", eval_every=0,
                  difficulty=4, prompts_per_step=4, group_size=4, threads=1, seed=3, entropy_coef=0.05, **SMALL_CACHE)
    return GRPOTrainer(load_config(None, {**common, **settings}))


@pytest.mark.parametrize("settings", [
    pytest.param(dict(minibatches=1, kl_coef=0.01), id="fused-one-forward"),
    pytest.param(dict(minibatches=2, micro_batch_size=3, share_prompts=False, rollout_shards=2, kl_coef=0.01),
                 id="micro-batches-two-shards"),
    pytest.param(dict(minibatches=2, kv_per_head=True, kl_coef=0.0), id="per-head-kept-sets"),
    # A quantized cache: the replay also fake-quantizes every layer's K/V with the rows' recorded scales (the hand
    # forward below does not, so it is checked against the recorded log-probs only).
    pytest.param(dict(minibatches=2, kv_dtype="int8", kl_coef=0.01), id="int8-cache"),
])
def test_pi_old_is_the_samplers_recorded_policy(tiny_model_dir, tmp_path, settings):
    trainer = _trainer(tiny_model_dir, tmp_path / "run", **settings)
    try:
        pipeline, model = trainer.pipeline, trainer.model
        data = pipeline._sample(1)
        pipeline._score(data)
        pipeline._recompute(data)
        pipeline._correct(data)
        batch, mask = data.batch, data.batch.response_mask.bool()
        shards = data.rollouts.shards
        assert len(shards) == settings.get("rollout_shards", 1)
        assert all(shard.evictions for shard in shards), "the cache should have compressed"
        # The loss's π_old is the sampler's policy: the loss's ratio is 1 at the update's start.
        assert (data.logp_old - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
        # ... while the dense policy is not (what the ξ metrics keep reporting).
        assert (data.logp_dense - batch.sampler_logprobs).abs()[mask].max() > 1e-2
        # Independently: a float64 forward written out here, under masks built from the eviction record.
        first = 0
        for shard in shards if settings.get("kv_dtype", "auto") == "auto" else ():
            expected, _ = hand_logprobs(model, shard, hand_masks(shard, model.config.num_hidden_layers))
            span, rows = shard.response_ids.shape[1], slice(first, first + len(shard))
            gap = (data.logp_old[rows, :span].double() - expected).abs()[shard.response_mask.bool()]
            assert gap.max() <= 1e-5
            first += len(shard)
        if settings["kl_coef"] > 0:  # the reference through the same attention: no drift before any update
            assert (data.logp_ref - data.logp_old).abs()[mask].max() <= 1e-6
        # The metrics: ξ is still the sampler against the dense policy, the loss's own ratio is logged apart.
        corrections = data.corrections
        assert corrections.metrics["xi_min"] < 0.99 and corrections.metrics["kept_token_frac"] == 1.0
        assert bool((corrections.weights[mask] == 1).all())
        metrics = data.learner_metrics
        assert metrics["learner_attention_sampler"] == 1.0
        assert metrics["learner_xi_min"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["learner_xi_max"] == pytest.approx(1.0, abs=1e-4)
        update = pipeline._update_policy(data)
        assert update["optimizer_steps"] >= 1
        if settings["minibatches"] == 1:  # one step from π_old's own forward: the ratio is 1 throughout
            assert update["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and update["clip_frac"] == 0.0
    finally:
        trainer.close()


def test_block_sparse_rollouts_train_through_their_pages(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path / "run", sparsity="block", block_page_size=4, block_dense_layers=1,
                       kv_budget=12, minibatches=2, kl_coef=0.0)
    try:
        data = trainer.pipeline._sample(1)
        trainer.pipeline._score(data)
        trainer.pipeline._recompute(data)
        mask = data.batch.response_mask.bool()
        assert data.batch.block_selections is not None
        assert (data.logp_old - data.batch.sampler_logprobs).abs()[mask].max() <= 1e-5
        assert (data.logp_dense - data.batch.sampler_logprobs).abs()[mask].max() > 1e-3
    finally:
        trainer.close()


# ---------------------------------------------------------------- the gradient
class _Capture:
    """An optimizer that keeps the gradient of its one step and moves nothing."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none: bool = True):
        for parameter in self.model.parameters():
            parameter.grad = None

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


def test_the_update_gradient_is_the_loss_through_the_replayed_attention():
    """ppo_update with π_θ through the sampler's attention (micro-batches, shared prompts, clip, KL, entropy) gives
    the gradient of the GRPO loss written out here over the float64 hand forward under hand-built masks."""
    model, tokenizer = make_tiny_model(seed=1)
    model = model.double()
    temperature = 0.8
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(8, min_letters=8).examples(3, seed=1)
               for _ in range(2)]
    sampling = SamplingConfig(max_new_tokens=24, temperature=temperature, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    batch = RolloutEngine(model, KVCompression("rkv", budget=10, window=3, interval=3)).generate(
        prompts, sampling, torch.Generator().manual_seed(0))
    assert batch.evictions
    learner = SamplerForward([batch], share_prompts=True, temperature=temperature)
    mask = batch.response_mask.bool()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        replayed, _ = learner.logprobs(model)
    assert (replayed - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
    # π_old and π_ref away from π_θ, so that the clip and the KL act; some tokens masked, weights not all 1.
    logp_old = replayed + 0.3 * torch.randn(replayed.shape, generator=generator, dtype=torch.float64)
    logp_ref = replayed + 0.2 * torch.randn(replayed.shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(len(batch), generator=generator, dtype=torch.float64)
    weights = 0.5 + torch.rand(replayed.shape, generator=generator, dtype=torch.float64)
    keep = (mask & (torch.rand(replayed.shape, generator=generator) > 0.2)).double()
    train = load_config(overrides={"minibatches": 1, "micro_batch_size": 4, "clip_eps": 0.2, "clip_eps_high": 0.28,
                                   "kl_coef": 0.1, "entropy_coef": 0.05, "grad_clip": 1e9,
                                   "share_prompts": True}).train
    capture = _Capture(model)
    ppo_update(model, capture, batch, logp_old, logp_ref, advantages, weights, keep, torch.Generator().manual_seed(0),
               train, temperature, policy_logprobs=functools.partial(learner.logprobs, model))

    logp, entropy = hand_logprobs(model, batch, hand_masks(batch, model.config.num_hidden_layers), temperature)
    coefficients = keep / keep.sum(1, keepdim=True).clamp(min=1) / len(batch)
    ratio = (logp - logp_old).exp()
    per_token = torch.maximum(-ratio * advantages[:, None], -ratio.clamp(0.8, 1.28) * advantages[:, None]) * weights
    d = logp_ref - logp
    loss = (coefficients * per_token).sum() + 0.1 * (coefficients * (d.exp() - 1 - d).clamp(-10, 10)).sum() \
        - 0.05 * (coefficients * entropy).sum()
    names = [n for n, _ in model.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    assert set(capture.grads) == set(names)
    scale = max(float(g.abs().max()) for g in expected.values())
    for name in names:
        # The model's head gives float32 logits by design (`model.forward.head_logits`): agreement to float32.
        assert float((capture.grads[name] - expected[name]).abs().max()) <= 1e-5 * scale, name


# ---------------------------------------------------------------- refused where it cannot run
def test_dense_rollouts_are_refused(tmp_path):
    for text in ("base: sparse-learner\nsparse_rollouts: false\n", "base: dense\nlearner_attention: sampler\n"):
        (tmp_path / "p.yaml").write_text(text)
        with pytest.raises(ConfigError, match="dense rollouts have none"):
            load_config(overrides={"mode": str(tmp_path / "p.yaml")})
    (tmp_path / "q.yaml").write_text("base: naive-sparse\nlearner_attention: sparse\n")
    with pytest.raises(ConfigError, match="learner_attention must be dense or sampler"):
        load_config(overrides={"mode": str(tmp_path / "q.yaml")})


def test_corrections_are_refused():
    with pytest.raises(ConfigError, match="nothing to correct"):
        load_config(overrides={"mode": "sparse-learner", "veto_threshold": "1e-4"})
    with pytest.raises(ConfigError, match="nothing to correct"):
        load_config(overrides={"mode": "sparse-learner", "is_mode": "truncate"})


@pytest.mark.parametrize("setting, message", [
    ({"speculative": True, "kv_budget": 64}, "--speculative true samples exactly from the dense policy"),
    ({"distill_sparse": True}, "--distill-sparse"),
])
def test_speculative_and_distill_sparse_are_refused(tiny_model_dir, tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        _trainer(tiny_model_dir, tmp_path / "run", **setting)


def test_other_libraries_trainers_refuse_it():
    from sparserl.interop import corrections_from_verl, verl_rollout_correction

    with pytest.raises(ConfigError, match="verl cannot run mode sparse-learner"):
        verl_rollout_correction("sparse-learner")
    with pytest.raises(ConfigError, match="verl cannot run mode sparse-learner"):
        corrections_from_verl({}, "sparse-learner")
    pytest.importorskip("trl")
    from sparserl.integrations.trl import SparseGRPOTrainer

    with pytest.raises(ConfigError, match="SparseGRPOTrainer cannot run mode sparse-learner"):
        SparseGRPOTrainer(correction="sparse-learner")


# ---------------------------------------------------------------- a run
def _args(model_dir, out, steps, *extra):
    return ["train", "--model", str(model_dir), "--out", str(out), "--steps", str(steps), "--mode", "sparse-learner",
            "--seed", "3", "--prompts-per-step", "4", "--group-size", "4", "--difficulty", "4", "--eval-examples", "8",
            "--eval-every", "2", "--checkpoint-every", "1", "--threads", "1", "--kv-budget", "10", "--kv-window", "3",
            "--kv-interval", "3", "--log-with", "none", "--lr", "3e-3", "--entropy-coef", "0.05",
            "--eval-sparse-inference", "true", *extra]


def test_a_run_trains_logs_checkpoints_and_resumes_exactly(tiny_model_dir, tmp_path):
    assert main(_args(tiny_model_dir, tmp_path / "straight", 3)) == 0
    assert main(_args(tiny_model_dir, tmp_path / "resumed", 2)) == 0
    assert main(_args(tiny_model_dir, tmp_path / "resumed", 3, "--resume")) == 0
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    assert [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in straight] == \
        [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in resumed]
    for record in straight[1:]:
        assert record["learner_attention_sampler"] == 1.0
        assert record["learner_xi_min"] == pytest.approx(1.0, abs=1e-4)
        assert record["learner_xi_max"] == pytest.approx(1.0, abs=1e-4)
        assert record["xi_min"] < 0.99  # the sampler against the dense policy, as in every mode
        assert record["kept_token_frac"] == 1.0 and "alpha_mean" in record and record["optimizer_steps"] >= 1
    assert "eval_accuracy_sparse" in straight[-1] and "eval_accuracy_dense" in straight[-1]
    step = Path("checkpoints") / "step_000003" / "policy" / "model.safetensors"
    a, b = load_file(tmp_path / "straight" / step), load_file(tmp_path / "resumed" / step)
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], start[k]) for k in a)
