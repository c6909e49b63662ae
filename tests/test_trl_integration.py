"""Sparse rollouts inside TRL's GRPOTrainer (`sparserl.integrations.trl`): with a dense sampler and no correction
the loss and gradients are TRL's own; the masks and weights TRL applies are `compute_corrections`' for every
preset; TRL's loss with them is sparserl's `ppo_loss`; and a sparse run through TRL learns the built-in task."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import make_tiny_model
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from sparserl.config.corrections import CorrectionConfig
from sparserl.config.presets import PRESETS, load_preset
from sparserl.errors import ConfigError
from sparserl.integrations.trl import SparseGRPOTrainer, SparseRollouts, check_trainer, generation_seeds
from sparserl.interop import corrections_from_trl
from sparserl.learner.corrections import compute_corrections
from sparserl.learner.grpo import kl_k3, ppo_loss, token_coefficients
from sparserl.model.forward import response_logprobs
from sparserl.model.loading import load_policy
from sparserl.tasks.pointer_walk import PointerWalkTask
from sparserl.train.evaluation import complete

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TASK = PointerWalkTask(letters=5)
SPARSE = {"kv_budget": 10, "kv_window": 2, "kv_interval": 2}


def _by_length(completions, **kwargs):
    """A reward that differs within a group (the random model earns no task reward), so advantages are not 0."""
    return [(len(text) % 5) / 4 for text in completions]


def _config(tmp_path, loss_type="grpo", **extra) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=14, max_steps=1, report_to="none", use_cpu=True, bf16=False,
                    save_strategy="no", logging_strategy="no", seed=0, gradient_checkpointing=False,
                    loss_type=loss_type)
    return GRPOConfig(**{**settings, **extra})


def _rows() -> list[dict]:
    """Two prompts, each repeated for its 4 generations, as TRL's sampler hands them."""
    return [{"prompt": e.prompt} for e in TASK.examples(2, seed=0) for _ in range(4)]


def _trainer(cls, model, tokenizer, tmp_path, loss_type="grpo", settings: dict | None = None, **kwargs):
    """A trainer of `cls` on 8 pointer-walk prompts; `settings`: GRPOConfig's beyond `_config`'s."""
    dataset = Dataset.from_list([{"prompt": e.prompt} for e in TASK.examples(8, seed=0)])
    trainer = cls(model=model, reward_funcs=_by_length, args=_config(tmp_path, loss_type, **(settings or {})),
                  train_dataset=dataset, processing_class=tokenizer, **kwargs)
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which these tests skip
    return trainer


def _loss_and_grads(trainer, inputs) -> tuple[float, list[torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in trainer.model.parameters()]


def test_dense_rollouts_without_a_correction_give_trls_own_loss(tmp_path):
    """TRL's own generation path (its `generate`, EOS masking, no sampler log-probs) against our dense rollout
    function with the `dense` preset, on the same completions: the same loss and gradients."""
    model, tokenizer = make_tiny_model(seed=1)
    ours = _trainer(SparseGRPOTrainer, copy.deepcopy(model), tokenizer, tmp_path / "ours",
                    rollout_func=SparseRollouts(dense=True), correction="dense")
    ours.model.train()
    ours_inputs = ours._generate_and_score_completions(_rows())
    completions, mask = ours_inputs["completion_ids"], ours_inputs["completion_mask"]

    theirs = _trainer(GRPOTrainer, copy.deepcopy(model), tokenizer, tmp_path / "theirs")
    theirs.model.train()

    def generate(input_ids, attention_mask=None, **kwargs):
        """What transformers' `generate` returns (prompt then completion, padded), given our completions."""
        return torch.cat([input_ids, torch.where(mask.bool(), completions, tokenizer.pad_token_id)], dim=1)

    theirs.model.generate = generate
    theirs_inputs = theirs._generate_and_score_completions(_rows())
    assert torch.equal(theirs_inputs["completion_ids"] * theirs_inputs["completion_mask"],
                       completions * ours_inputs["completion_mask"])
    assert theirs_inputs.get("sampling_per_token_logps") is None and "tool_mask" not in theirs_inputs
    loss_ours, grads_ours = _loss_and_grads(ours, ours_inputs)
    loss_theirs, grads_theirs = _loss_and_grads(theirs, theirs_inputs)
    # At π_θ = π_old the loss is −mean(A) (0 up to rounding: advantages are centred per group); the gradients are not.
    assert loss_ours == pytest.approx(loss_theirs, rel=1e-6, abs=1e-9)
    assert sum(float(g.abs().sum()) for g in grads_theirs) > 1e-3
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(grads_ours, grads_theirs))


# Every preset but those that train through the sampler's attention, which TRL's dense loss cannot (refused:
# tests/test_sparse_learner.py).
@pytest.mark.parametrize("preset", sorted(name for name, p in PRESETS.items() if p.learner_attention == "dense"))
def test_the_masks_and_weights_trl_applies_are_compute_corrections(tmp_path, monkeypatch, preset):
    model, tokenizer = make_tiny_model(seed=2)
    trainer = _trainer(SparseGRPOTrainer, model, tokenizer, tmp_path, rollout_func=SparseRollouts(**SPARSE),
                       correction=preset)
    seen = {}
    plain = GRPOTrainer._generate_and_score_completions

    def record(self, inputs):
        out = plain(self, inputs)
        seen.update({k: v.clone() for k, v in out.items() if k in ("advantages", "completion_mask")})
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", record)
    trainer.model.train()  # as in TRL's training loop: the metrics go to its "train" log
    out = trainer._generate_and_score_completions(_rows())
    width, mask = out["prompt_ids"].shape[1], seen["completion_mask"]
    # π_old by sparserl's own forward (positions from the mask), independent of TRL's.
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], mask], dim=1)
    with torch.no_grad():
        old, _ = response_logprobs(trainer.model, ids, attention, width)
    expected = compute_corrections(old, out["sampling_per_token_logps"], mask, load_preset(preset).correction)
    assert torch.equal(out["tool_mask"], (mask * expected.keep_mask).to(mask.dtype))
    torch.testing.assert_close(out["advantages"], seen["advantages"][:, None] * expected.weights, rtol=1e-5,
                               atol=1e-7)
    assert trainer._metrics["train"]["sparserl/xi_mean"]  # the correction's metrics reach TRL's logger



@pytest.mark.parametrize(("loss_type", "aggregation", "beta", "bias_correction"), [
    ("grpo", "seq-mean-token-mean", 0.0, True), ("dapo", "token-mean", 0.0, True),
    ("grpo", "seq-mean-token-mean", 0.5, False), ("grpo", "seq-mean-token-mean", 0.5, True)])
def test_trls_loss_with_the_corrections_is_sparserls_ppo_loss(tmp_path, loss_type, aggregation, beta,
                                                              bias_correction):
    """With beta != 0 TRL adds β·k3 (of log π_ref − log π_θ) on the kept tokens, in the loss's own aggregation and
    not weighted by the correction's importance weights: the term of sparserl's own `ppo_loss` (`kl_coef`). TRL
    1.16's default `use_bias_correction_kl=True` multiplies it by π_θ/π_old: 1 in value here (π_old is these
    weights), while its gradient gains β·k3·∇log π_θ."""
    reference, tokenizer = make_tiny_model(seed=3)
    reference.save_pretrained(tmp_path / "reference")  # TRL loads its reference model from the policy's path
    trainer = _trainer(SparseGRPOTrainer, type(reference).from_pretrained(tmp_path / "reference"), tokenizer,
                       tmp_path, loss_type, dict(beta=beta, use_bias_correction_kl=bias_correction),
                       rollout_func=SparseRollouts(**SPARSE), correction="sparse-rl")
    torch.manual_seed(0)
    with torch.no_grad():  # the policy moved away from the reference, so that the KL and its gradient are not 0
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(_rows())
    loss_trl, grads_trl = _loss_and_grads(trainer, inputs)
    # sparserl's own loss on the same batch: π_θ and π_ref from its forward, the corrections from their oracle.
    trainer.model.zero_grad()
    width = inputs["prompt_ids"].shape[1]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logp, _ = response_logprobs(trainer.model, ids, attention, width)
    with torch.no_grad():
        logp_ref, _ = response_logprobs(reference, ids, attention, width)
    corrections = compute_corrections(logp.detach(), inputs["sampling_per_token_logps"], inputs["completion_mask"],
                                      load_preset("sparse-rl").correction)
    weights = corrections.weights
    total = weights.sum(dim=1)  # each row's advantage back from TRL's per-token A·w: Σ A·w / Σ w
    advantages = torch.where(total > 0, inputs["advantages"].sum(dim=1) / total.clamp(min=1e-30), 0.0)
    coefficients = token_coefficients(corrections.keep_mask, aggregation)
    terms = ppo_loss(logp, logp.detach(), advantages, weights, coefficients, 0.2, 0.2, kl_coef=beta,
                     logp_ref=logp_ref)
    loss = terms.loss
    if beta and bias_correction:  # k3 · (π_θ/π_old − 1) to first order: 0 in value, k3·∇log π_θ in gradient
        loss = loss + beta * (coefficients * kl_k3(logp, logp_ref).detach() * (logp - logp.detach())).sum()
    loss.backward()
    assert beta == 0 or terms.kl > 1e-3
    # The policy term is a sum of ±A·w terms of size ~0.5 that nearly cancel: float32 rounding of each term (π_old
    # from two forwards) stays below 1e-6 of their size.
    assert float(loss) == pytest.approx(loss_trl, abs=1e-6)
    for ours, theirs in zip((p.grad for p in trainer.model.parameters()), grads_trl):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)


def test_refuses_a_sampler_it_cannot_record(tmp_path):
    model, tokenizer = make_tiny_model()
    trainer = _trainer(SparseGRPOTrainer, model, tokenizer, tmp_path, rollout_func=SparseRollouts(**SPARSE))
    trainer.args.top_p = 0.9
    with pytest.raises(ValueError, match="top_p"):
        trainer._generate_and_score_completions(_rows())


def test_ignore_eos_gives_every_completion_the_full_length(tmp_path):
    """A rollout setting the sampler takes is honoured, not dropped: with `ignore_eos` no row stops at EOS, which
    a random model over this vocabulary samples now and then (so without it some rows end early)."""
    model, tokenizer = make_tiny_model(seed=3)
    prompts = [row["prompt"] for row in _rows()] * 4
    lengths = {}
    for ignore in (False, True):
        trainer = _trainer(SparseGRPOTrainer, model, tokenizer, tmp_path, rollout_func=SparseRollouts(
            dense=True, ignore_eos=ignore))
        trainer.args.max_completion_length = trainer.max_completion_length = 60
        lengths[ignore] = [len(c) for c in trainer.rollout_func(prompts, trainer)["completion_ids"]]
    assert min(lengths[False]) < 60
    assert lengths[True] == [60] * len(prompts)


def test_a_sparse_run_through_trl_learns_the_builtin_task(tmp_path):
    """The shipped warm-started model on 4 pointer-walk prompts, 8 TRL steps of 4 x 8 R-KV rollouts (B = 80, the
    paper regime) under geo-rs: the batch reward rises over the steps, and so does the mean reward of 16 samples
    a prompt drawn by the same seeds before and after (0.33 -> 0.47 on the machine that wrote this test)."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(None)
    task = PointerWalkTask()
    examples = task.examples(4, seed=5, split="train")

    def walk(completions, demonstration, **kwargs):
        return task.reward(completions, demonstration=demonstration)

    def sampled_reward() -> float:
        done = complete(model, tokenizer, examples, task.default_max_new_tokens, temperature=1.0, samples=16, seed=99)
        return sum(walk(done.texts, [e.demonstration for e in examples for _ in range(16)])) / len(done.texts)

    before = sampled_reward()
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=32, num_generations=8,
                        max_completion_length=task.default_max_new_tokens, max_steps=8, learning_rate=2e-4,
                        temperature=1.0, beta=0.0, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                        report_to="none", seed=0, gradient_checkpointing=False)
    dataset = Dataset.from_list([{"prompt": e.prompt, "demonstration": e.demonstration} for e in examples])
    trainer = SparseGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=walk, args=config,
                                train_dataset=dataset, rollout_func=SparseRollouts(kv_budget=80), correction="geo-rs")
    trainer.train()
    logs = [record for record in trainer.state.log_history if "reward" in record]
    rewards = [record["reward"] for record in logs]
    assert len(rewards) == 8 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05
    assert sampled_reward() > before + 0.05
    # The cache was compressed: its peak below what a dense cache of the same rows would reach.
    assert all(0.3 < record["sparserl/kv_peak_bytes"] / record["sparserl/kv_dense_bytes"] < 1
               and "sparserl/xi_mean" in record for record in logs)


# ------------------------------------------------------------------------ honoured or refused, in one line
def _preset_file(tmp_path) -> str:
    """A user's preset: geo-rs's filter with wider bounds, token weights on; its fields read in YAML's own types
    (a bound list, a float written without a dot, which YAML reads as a string)."""
    path = tmp_path / "wide-geo.yaml"
    path.write_text("base: geo-rs\ncorrection: {seq_geo_bounds: [0.5, 2.0], is_mode: truncate, is_cap: 3,\n"
                    "             veto_threshold: 1e-6}\n")
    return str(path)


def test_a_yaml_presets_correction_fields_are_what_trl_trains_with(tmp_path):
    """The trainer's resolved correction is the file's fields on its base, and the masks and weights it hands TRL
    are `compute_corrections`' under that correction (not the base preset's, which the file's metrics would hide)."""
    model, tokenizer = make_tiny_model(seed=2)
    preset = _preset_file(tmp_path)
    trainer = _trainer(SparseGRPOTrainer, model, tokenizer, tmp_path, rollout_func=SparseRollouts(**SPARSE),
                       correction=preset)
    expected_config = CorrectionConfig(veto_threshold=1e-6, band=None, seq_geo_bounds=(0.5, 2.0), is_mode="truncate",
                                       is_cap=3.0, batch_normalize=False)
    assert trainer.correction == expected_config
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    with torch.no_grad():
        old, _ = response_logprobs(trainer.model, ids, torch.cat([out["prompt_mask"], mask], dim=1),
                                   out["prompt_ids"].shape[1])
    expected = compute_corrections(old, out["sampling_per_token_logps"], mask, expected_config)
    assert torch.equal(out["tool_mask"], (mask * expected.keep_mask).to(mask.dtype))


def test_a_yaml_presets_correction_reaches_the_interop_helpers(tmp_path):
    old = torch.tensor([[-1.0, -1.2, -1.0], [-1.0, -3.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3)
    batch = {"old_per_token_logps": old, "sampling_per_token_logps": sampler, "completion_mask": mask}
    # Row 1's geometric-mean ξ is e^(-2/3) = 0.51: outside geo-rs's [0.905, 1.105], inside the file's [0.5, 2].
    assert corrections_from_trl(batch, "geo-rs").seq_keep.tolist() == [True, False]
    assert corrections_from_trl(batch, _preset_file(tmp_path)).seq_keep.tolist() == [True, True]


def test_a_bad_field_in_a_preset_file_is_said_with_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base: geo-rs\ncorrection: {is_cap: lots}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*is_cap"):
        SparseGRPOTrainer(model=None, correction=str(path))


@pytest.mark.parametrize(("setting", "value"), [
    ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("generation_kwargs", {"top_p": 0.5}),
    ("cache_implementation", "static"), ("use_transformers_paged", True),
    ("use_transformers_continuous_batching", True), ("vllm_gpu_memory_utilization", 0.5),
    ("vllm_importance_sampling_mode", "token_truncate"), ("ds3_gather_for_generation", False)])
def test_a_trl_generation_setting_the_sampler_cannot_honour_is_refused_at_construction(tmp_path, setting, value):
    model, tokenizer = make_tiny_model()
    dataset = Dataset.from_list([{"prompt": e.prompt} for e in TASK.examples(8, seed=0)])
    with pytest.raises(ConfigError, match=setting):
        SparseGRPOTrainer(model=model, reward_funcs=_by_length, args=_config(tmp_path, **{setting: value}),
                          train_dataset=dataset, processing_class=tokenizer, rollout_func=SparseRollouts(**SPARSE))


def test_a_correction_without_sampler_logprobs_is_refused(tmp_path):
    model, tokenizer = make_tiny_model()
    dataset = Dataset.from_list([{"prompt": e.prompt} for e in TASK.examples(8, seed=0)])
    with pytest.raises(ConfigError, match="rollout_func=SparseRollouts"):
        SparseGRPOTrainer(model=model, reward_funcs=_by_length, args=_config(tmp_path), train_dataset=dataset,
                          processing_class=tokenizer, correction="geo-rs")


def test_tools_are_refused_with_sparse_rollouts(tmp_path):
    """TRL's tool loop would write the post-tool completions with its own sampler (a trainer with tools needs a
    chat template this tokenizer lacks, so the check runs on the settings alone)."""
    trainer = type("Trainer", (), {"args": _config(tmp_path), "tools": [len], "environment_factories": None,
                                   "is_fsdp_enabled": False, "is_deepspeed_enabled": False})()
    with pytest.raises(ConfigError, match="tool"):
        check_trainer(trainer)


@pytest.mark.parametrize(("keyword", "hint"), [("lr", "learning_rate"), ("mode", "correction="),
                                               ("temperature", "GRPOConfig\\(temperature"),
                                               ("rollout_workers", "not a sampler setting")])
def test_sparse_rollouts_refuses_what_its_sampler_does_not_read(keyword, hint):
    with pytest.raises(ConfigError, match=hint):
        SparseRollouts(**{keyword: {"lr": 1e-5, "mode": "geo-rs", "temperature": 0.7, "rollout_workers": 2}[keyword]})


@pytest.mark.parametrize("sampler", [{"dense": True}, {"speculative": True}])
def test_alpha_is_refused_where_the_samples_are_the_dense_policys(sampler):
    with pytest.raises(ConfigError, match="measure_alpha"):
        SparseRollouts(measure_alpha=True, **sampler)


def test_two_generation_batches_of_one_step_draw_different_completions(tmp_path):
    """gradient_accumulation_steps=2 with steps_per_generation=1: the step generates twice, from the same weights
    and (here) the same prompts; the two batches must be two draws, not one twice."""
    model, tokenizer = make_tiny_model(seed=4)
    prompt = TASK.examples(1, seed=0)[0].prompt
    dataset = Dataset.from_list([{"prompt": prompt}] * 8)
    args = _config(tmp_path, gradient_accumulation_steps=2, steps_per_generation=1, per_device_train_batch_size=4,
                   learning_rate=0.0, shuffle_dataset=False)
    rollouts = SparseRollouts(**SPARSE)
    drawn = []

    def recording(prompts, trainer):
        out = rollouts(prompts, trainer)
        drawn.append(out["completion_ids"])
        return out

    trainer = SparseGRPOTrainer(model=model, reward_funcs=_by_length, args=args, train_dataset=dataset,
                                processing_class=tokenizer, rollout_func=recording, correction="sparse-rl")
    trainer.train()
    assert len(drawn) == 2 and drawn[0] != drawn[1]


def test_a_resumed_run_draws_a_steps_generation_with_the_same_seeds(tmp_path):
    """Seeds are a function of the run's state that a resumed run restores: the step, and the micro-step within it
    (which restarts at every optimizer step, as a resumed trainer's count does)."""
    def state(global_step, micro_steps_so_far):
        trainer = type("Trainer", (), {})()
        trainer.args, trainer.accelerator = _config(tmp_path), type("Accelerator", (), {"process_index": 0})()
        trainer.state = type("State", (), {"global_step": global_step})()
        trainer._step, trainer.current_gradient_accumulation_steps = micro_steps_so_far, 2
        return trainer

    uninterrupted = [generation_seeds(state(3, 6 + k), 4) for k in (0, 1)]
    resumed = [generation_seeds(state(3, k), 4) for k in (0, 1)]
    assert uninterrupted == resumed and uninterrupted[0] != uninterrupted[1]


def test_speculative_rollouts_log_their_acceptance_and_kv_figures_per_row(tmp_path):
    """The speculative sampler's statistics reach TRL's log, and its KV figures are per row: its peak is its dense
    cache plus the slack that holds rejected drafts (about 1.1-1.2x), not a group's prompt counted once (4x)."""
    model, tokenizer = make_tiny_model(seed=5)
    trainer = _trainer(SparseGRPOTrainer, model, tokenizer, tmp_path, correction="dense",
                       rollout_func=SparseRollouts(speculative=True, speculative_draft="window", kv_budget=10))
    trainer.model.train()
    trainer._generate_and_score_completions(_rows())
    logged = trainer._metrics["train"]
    assert logged["sparserl/spec_acceptance_rate"] and logged["sparserl/spec_tokens_per_verification"]
    assert 1.0 <= logged["sparserl/kv_peak_bytes"][0] / logged["sparserl/kv_dense_bytes"][0] < 1.5


# The GRPOConfig settings the sampler reads from TRL's trainer, and those TRL applies itself around the sampler (the
# loss, rewards, batching, logging, model loading) or that reach the sampler through the model TRL hands it
# (`disable_dropout`, `cast_lm_head_to_fp32`), as read in TRL 1.16's source.
SAMPLER_READS = ("temperature", "max_completion_length", "chat_template_kwargs")
TRL_APPLIES = (
    "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "disable_dropout", "cast_lm_head_to_fp32",
    "num_generations", "num_generations_eval", "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size",
    "steps_per_generation", "beta", "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg",
    "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "importance_sampling_level", "reward_weights", "multi_objective_aggregation", "scale_rewards", "loss_type",
    "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
    "entropy_coef_delta", "entropy_target", "off_policy_mask_threshold", "use_bias_correction_kl", "log_completions",
    "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo")


def test_every_grpo_setting_is_read_applied_or_refused():
    """TRL 1.16's GRPOConfig settings (beyond transformers' TrainingArguments), each in exactly one class: read by
    the sampler, applied by TRL around it, or refused because only TRL's own sampler would read it (the
    integration's `TRL_GENERATION_ONLY` and every `vllm_*`)."""
    import dataclasses

    from transformers import TrainingArguments

    from sparserl.integrations.trl import TRL_GENERATION_ONLY

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    for name in (f.name for f in dataclasses.fields(GRPOConfig) if f.name not in base):
        classes = [name in SAMPLER_READS, name in TRL_APPLIES,
                   name in TRL_GENERATION_ONLY or name.startswith("vllm_")]
        assert sum(classes) == 1, f"GRPOConfig.{name}: in {sum(classes)} classes"
