"""DistillSparse: the sampler's LoRA is invisible at zero, never seen by the dense side, replayed
exactly, trained, checkpointed and resumed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import kill_part_way_then_resume, make_tiny_model, replay_logprobs
from safetensors.torch import load_file

from sparserl.cli import main
from sparserl.learner.distill import DistillConfig, DistillTrainer
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.adapter import AdapterConfig, SamplerAdapter
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.tasks.pointer_walk import PointerWalkTask
from sparserl.train.metrics import read_metrics

COMPRESSION = KVCompression("rkv", budget=10, window=3, interval=3)


def _sample(model, tokenizer, seed=0):
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(8, min_letters=8).examples(6, seed=1)]
    sampling = SamplingConfig(max_new_tokens=30, temperature=1.0, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    return RolloutEngine(model, COMPRESSION).generate(prompts, sampling, torch.Generator().manual_seed(seed))


def _perturb(adapter: SamplerAdapter, scale=0.3):
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in adapter.parameters.items():
            if "lora_B" in name:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))


def test_an_adapter_at_zero_changes_nothing():
    model, tokenizer = make_tiny_model()
    plain = _sample(model, tokenizer)
    adapter = SamplerAdapter(model, AdapterConfig())
    assert all(float(p.detach().abs().sum()) == 0 for n, p in adapter.parameters.items() if "lora_B" in n)
    with adapter.active():
        adapted = _sample(model, tokenizer)
    assert torch.equal(plain.response_ids, adapted.response_ids)
    assert torch.equal(plain.sampler_logprobs, adapted.sampler_logprobs)


def test_the_dense_side_never_sees_the_adapter_and_the_replay_does():
    model, tokenizer = make_tiny_model()
    untouched = copy.deepcopy(model)
    adapter = SamplerAdapter(model, AdapterConfig())
    _perturb(adapter)
    with adapter.active():
        batch = _sample(model, tokenizer)
    width = batch.prompt_ids.shape[1]
    dense = batched_logprobs(model, batch.input_ids, batch.attention_mask, width, 64)
    reference = batched_logprobs(untouched, batch.input_ids, batch.attention_mask, width, 64)
    assert torch.equal(dense, reference)  # adapter off outside `active()`: bitwise the plain policy
    with adapter.active():
        replayed = replay_logprobs(model, batch)
    mask = batch.response_mask.bool()
    assert (replayed - batch.sampler_logprobs).abs()[mask].max() <= 1e-5
    assert (dense - batch.sampler_logprobs).abs()[mask].max() > 1e-2  # the adapter does change the sampler


def test_alpha_replays_the_adapted_sampler_when_its_distributions_are_not_kept(monkeypatch):
    """On a large vocabulary α comes from the replay: under the adapter it equals α from the
    adapted sampler's recorded distributions, and without it, it would measure another sampler."""
    from sparserl.learner.alpha import rollout_acceptance
    from sparserl.rollout.engine import engine as engine_module

    model, tokenizer = make_tiny_model()
    adapter = SamplerAdapter(model, AdapterConfig())
    _perturb(adapter)
    prompts = [tokenizer(e.prompt).input_ids for e in PointerWalkTask(8, min_letters=8).examples(6, seed=1)]
    sampling = SamplingConfig(30, 1.0, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    with adapter.active():
        recorded = RolloutEngine(model, COMPRESSION, record_distributions=True).generate(
            prompts, sampling, torch.Generator().manual_seed(0))
        monkeypatch.setattr(engine_module, "FULL_DISTRIBUTION_VOCAB", model.config.vocab_size - 1)
        replayed = RolloutEngine(model, COMPRESSION, record_distributions=True).generate(
            prompts, sampling, torch.Generator().manual_seed(0))
    assert replayed.sampler_distribution is None
    expected = rollout_acceptance(model, recorded, 1.0)
    assert (rollout_acceptance(model, replayed, 1.0, sampler_context=adapter.active) - expected).abs().max() <= 1e-5
    assert (rollout_acceptance(model, replayed, 1.0) - expected).abs().max() > 1e-2


def test_a_distill_step_moves_only_the_adapter_toward_the_dense_policy():
    model, tokenizer = make_tiny_model()
    adapter = SamplerAdapter(model, AdapterConfig())
    distill = DistillTrainer(adapter, DistillConfig(lr=3e-3, kl_coef=1.0))
    _perturb(adapter)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kls = []
    for _ in range(4):
        with adapter.active():
            batch = _sample(model, tokenizer)
        kls.append(distill.train_step([batch], torch.zeros(len(batch)), micro_batch_size=64)["distill_kl"])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(adapter.parameters)
    assert kls[-1] < kls[0]  # zero advantages: only the KL term pulls, and it pulls the sampler to dense


def _train(model_dir, out, steps, *extra):
    return ["train", "--model", str(model_dir), "--out", str(out), "--steps", str(steps), "--mode", "sparse-tis",
            "--distill-sparse", "true", "--distill-lr", "3e-3", "--seed", "3", "--prompts-per-step", "4",
            "--group-size", "4", "--difficulty", "4", "--eval-examples", "8", "--eval-every", "2",
            "--checkpoint-every", "1", "--threads", "1", "--kv-budget", "10", "--kv-window", "3", "--kv-interval",
            "3", "--log-with", "none", "--entropy-coef", "0.05", "--lr", "3e-3", *extra]


def test_training_checkpoints_the_adapter_apart_and_resumes_exactly(tiny_model_dir, tmp_path):
    assert main(_train(tiny_model_dir, tmp_path / "straight", 3)) == 0
    assert main(_train(tiny_model_dir, tmp_path / "resumed", 2)) == 0
    assert main(_train(tiny_model_dir, tmp_path / "resumed", 3, "--resume")) == 0
    timings = ("rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac")
    straight, resumed = ([{k: v for k, v in r.items() if k not in timings} for r in read_metrics(d / "metrics.jsonl")]
                         for d in (tmp_path / "straight", tmp_path / "resumed"))
    assert straight == resumed
    assert all("distill_kl" in r and "alpha_tail" in r for r in straight if r["step"] > 0)
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_000003"
    policy = load_file(checkpoint / "policy" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in policy)  # a plain model directory
    plain = load_file(tiny_model_dir / "model.safetensors")
    assert set(policy) == set(plain)
    adapter = load_file(checkpoint / "sampler_adapter" / "adapter.safetensors")
    assert adapter and all("lora_" in k for k in adapter)


@pytest.mark.slow  # 22 s; test_training_checkpoints_the_adapter_apart_and_resumes_exactly stays in the suite
def test_sigkill_then_resume_repeats_the_uninterrupted_run_adapter_included(tiny_model_dir, tmp_path):
    steps = 12
    assert main(_train(tiny_model_dir, tmp_path / "straight", steps)) == 0
    killed = tmp_path / "killed"
    kill_part_way_then_resume(_train(tiny_model_dir, killed, steps), killed, steps, lines=5)
    timings = ("rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac")
    straight, resumed = ([{k: v for k, v in r.items() if k not in timings} for r in read_metrics(d / "metrics.jsonl")]
                         for d in (tmp_path / "straight", killed))
    assert straight == resumed
    final = [load_file(d / "checkpoints" / f"step_{steps:06d}" / "sampler_adapter" / "adapter.safetensors")
             for d in (tmp_path / "straight", killed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_distill_needs_sparse_rollouts():
    from sparserl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs sparse rollouts"):
        load_config(overrides={"mode": "dense", "distill_sparse": "true"})
