"""Sparse rollouts inside TRL's `GRPOTrainer`: a rollout function that samples with sparserl's engine, and the
corrections that make those samples safe to train on.

TRL (1.16) takes a custom sampler through `GRPOTrainer(rollout_func=...)`, but it corrects the sampler's log-probs
only with vLLM (`use_vllm=True`): a sparse sampler plugged in alone is trained on as if it were the policy. So:

    from sparserl.integrations.trl import SparseGRPOTrainer, SparseRollouts

    trainer = SparseGRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(..., bf16=False), train_dataset=dataset,
        rollout_func=SparseRollouts(kv_policy="rkv", kv_budget=256),   # any sparserl sampler
        correction="geo-rs")                                           # any sparserl preset, or a CorrectionConfig

- `SparseRollouts` samples each generation batch with the trainer's own model (the object its optimizer updates:
  no copy, no weight sync), with a compressed KV cache (`kv_policy`, `kv_budget`, ...), block-sparse attention
  (`sparsity="block"`) or lossless speculative rollouts (`speculative=True`), under sparserl's rows-in-flight
  scheduler and KV memory budget, and returns the sampler's exact log-probs at TRL's temperature.
- `SparseGRPOTrainer` recomputes π_old densely once per generation batch, computes the preset's corrections
  (`learner.corrections.compute_corrections`: ξ = π_old / π_sampler, filters, importance weights) over the whole
  batch, and hands them to TRL's own loss through the two inputs it already has: the importance weights as
  per-token advantages (A · w, `[B, T]`: TRL's clipped objective is linear in A, so this is w times its per-token
  term) and the kept tokens as `tool_mask` (which TRL applies to the loss's sum and its normaliser). Every
  correction metric and the sampler's KV figures reach TRL's logger as `sparserl/<name>`.

Settings TRL has and the sampler reads: `temperature`, `max_completion_length`, the tokenizer's EOS and pad;
`top_p`/`top_k`/`min_p` are refused (the sampler's recorded log-probs are the plain tempered distribution's).
Use `bf16=False` on a CPU: TRL's bf16 autocast alone puts a dense ξ at 0.995-1.006.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from ..config.corrections import CorrectionConfig
from ..config.presets import load_preset
from ..config.schema import load_config
from ..learner.alpha import rollout_alpha_metrics
from ..learner.corrections import compute_corrections
from ..rollout.batch import RolloutBatch, SamplingConfig
from ..rollout.dispatch.scheduler import RowLimits, request_seed, schedule_rollouts
from ..rollout.dispatch.spec import SamplerCache, SamplerSpec
from ..rollout.sparsity.settings import sparsity_from_config
from ..rollout.speculative.drafts import draft_from_config


class SparseRollouts:
    """A `rollout_func` for TRL's `GRPOTrainer` that samples with sparserl.

    Keyword arguments are sparserl's rollout settings, as `sparserl train` takes them (`kv_policy`, `kv_budget`,
    `kv_window`, `kv_interval`, `sparsity`, `block_*`, `speculative`, `speculative_draft`, `draft_tokens`,
    `rollout_kv_memory`, `max_concurrent_rows`, `ignore_eos` (every completion `max_completion_length` long, as
    benchmarks want), and the policies' own options); `dense=True` samples with the full cache (the same engine,
    no compression). `measure_alpha`: also measure Sparrow's acceptance rate α of
    each batch against the dense policy (a dense forward and, on a large vocabulary, a replay of the sampler).
    """

    def __init__(self, dense: bool = False, measure_alpha: bool = False, **rollout: Any):
        self.rollout = load_config(None, rollout).rollout  # validated as `sparserl train` validates it
        self.dense = dense
        self.measure_alpha = measure_alpha and not dense and not self.rollout.speculative
        self.spec = SamplerSpec(
            sparsity=None if dense or self.rollout.speculative else sparsity_from_config(self.rollout),
            draft=draft_from_config(self.rollout) if self.rollout.speculative else None,
            draft_tokens=self.rollout.draft_tokens, record_evictions=False,
            record_distributions=self.measure_alpha)
        self.samplers: SamplerCache | None = None
        self.last_metrics: dict[str, float] = {}  # of the last batch: KV figures, rows in flight, α

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        _check_sampling(trainer)
        policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        if self.samplers is None or self.samplers.model is not policy:
            self.samplers = SamplerCache(policy)
        tokenizer = trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text side
        prompt_ids = _tokenize(prompts, trainer, tokenizer)
        sampling = SamplingConfig(
            max_new_tokens=trainer.max_completion_length, temperature=trainer.temperature,
            eos_token_id=None if self.rollout.ignore_eos else tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            prompt_width=max(len(p) for p in prompt_ids), **_row_limits(self.rollout, policy))
        # One seed per row, a function of the run's seed, the step and the process, as sparserl's own steps.
        step_seed = (trainer.args.seed * 1_000_003 + trainer.state.global_step) * 1024 + trainer.accelerator.process_index
        seeds = [request_seed(step_seed, row) for row in range(len(prompt_ids))]
        was_training = policy.training
        policy.eval()
        try:
            batch = schedule_rollouts(self.samplers.get(self.spec), prompt_ids, sampling, seeds)
            if self.measure_alpha:
                self.last_metrics = rollout_alpha_metrics(policy, [batch], trainer.temperature,
                                                          self.rollout.alpha_bin_size)
        finally:
            policy.train(was_training)
        self.last_metrics = {**self.last_metrics, **batch.kv.summary(batch.rollout_seconds),
                             "rollout_s": batch.rollout_seconds}
        for key, value in self.last_metrics.items():  # averaged over processes by TRL when it logs
            trainer._log_metric(f"sparserl/{key}", float(value))
        return _as_lists(batch, prompt_ids)


def _check_sampling(trainer: GRPOTrainer) -> None:
    """The sampler draws from the plain tempered distribution; refuse settings that would make TRL's idea of the
    sampler another one."""
    narrowed = [name for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", None))
                if getattr(trainer.args, name, off) not in (off, None, -1)]
    if narrowed:
        raise ValueError(f"SparseRollouts samples from the whole tempered distribution; set {', '.join(narrowed)} "
                         "off in GRPOConfig (top_p=1.0, top_k=0, min_p=None)")
    extra_eos = set(getattr(trainer, "eos_token_ids", []) or []) - {trainer.processing_class.eos_token_id}
    if extra_eos:
        warnings.warn(f"SparseRollouts stops at the tokenizer's EOS only, not at {sorted(extra_eos)}")


def _tokenize(prompts: list, trainer: GRPOTrainer, tokenizer) -> list[list[int]]:
    """Prompt ids as TRL's own generation path makes them: text as the processing class tokenizes it, chat
    messages through the chat template with the generation prompt."""
    if prompts and isinstance(prompts[0], list):
        return [list(ids) for ids in tokenizer.apply_chat_template(
            conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True,
            chat_template=getattr(trainer, "chat_template", None), **(getattr(trainer, "chat_template_kwargs", None)
                                                                         or {}))["input_ids"]]
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


def _row_limits(rollout, model) -> dict:
    limits = RowLimits.from_rollout_config(rollout, next(model.parameters()).device)
    return {"kv_memory_bytes": limits.kv_memory_bytes, "max_rows": limits.max_rows}


def _as_lists(batch: RolloutBatch, prompt_ids: list[list[int]]) -> dict[str, list]:
    """What TRL's rollout contract asks for: unpadded ids and log-probs, a completion ending at its EOS."""
    lengths = batch.response_lengths.tolist()
    return {"prompt_ids": prompt_ids,
            "completion_ids": [batch.response_ids[i, :n].tolist() for i, n in enumerate(lengths)],
            "logprobs": [batch.sampler_logprobs[i, :n].tolist() for i, n in enumerate(lengths)]}


class SparseGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with a sparserl correction applied to its loss (see the module).

    `correction`: a preset's name (`sparserl presets`: sparse-rl, geo-rs, ...), a preset YAML file, or a
    `CorrectionConfig`. With `dense` (no correction) and a dense sampler the loss is TRL's own.
    """

    def __init__(self, *args, correction: str | CorrectionConfig = "sparse-rl", **kwargs):
        super().__init__(*args, **kwargs)
        self.correction = correction if isinstance(correction, CorrectionConfig) else load_preset(correction).correction

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampler = out.get("sampling_per_token_logps")
        if sampler is None:  # TRL sampled itself: nothing recorded to correct against
            return out
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        old = out.get("old_per_token_logps")
        if old is None:  # TRL skips π_old when no optimizer step separates sampling from the loss: the same weights
            old = self._dense_old_logps(out)
        corrections = compute_corrections(old, sampler, mask, self.correction)
        out["advantages"] = out["advantages"][:, None] * corrections.weights.to(out["advantages"].dtype)
        out["tool_mask"] = (mask * corrections.keep_mask).to(out["completion_mask"].dtype)
        out["num_items_in_batch"] = self.accelerator.gather(out["tool_mask"].sum()).sum()
        mode = "train" if self.model.training else "eval"
        for key, value in corrections.metrics.items():
            self._metrics[mode][f"sparserl/{key}"].append(float(value))
        return out

    @torch.no_grad()
    def _dense_old_logps(self, out: dict) -> torch.Tensor:
        """π_old of the batch's completions `[B, T]`: TRL's own forward at the current weights, at its temperature."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, out["completion_ids"].size(1),
                                                                 batch_size=self.args.per_device_train_batch_size)
        return old

