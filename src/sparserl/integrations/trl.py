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

Every TRL setting is honoured or refused when the trainer is built, in one line naming it. The sampler reads
`temperature`, `max_completion_length`, `chat_template_kwargs`, the tokenizer's EOS and pad, and `seed`; the
settings that shape only TRL's own generation (`top_p`, `top_k`, `min_p`, `repetition_penalty`,
`generation_kwargs`, `cache_implementation`, `use_vllm`, transformers' paged or continuous batching, `tools`,
`environment_factory`) are refused, since the recorded log-probs are the plain tempered distribution's; so are
ZeRO-3 and FSDP, whose sharded weights the sampler cannot run. Under `accelerate launch` the rows of every process
draw their own seeds, and the corrections (batch normalisation included), their metrics and the sampler's figures
are the whole generation batch's, as one process holding it computes them. Use `bf16=False` on a CPU: TRL's bf16
autocast alone puts a dense ξ at 0.995-1.006. A mode that trains through the sampler's attention (`sparse-learner`)
is refused: TRL's loss runs its own dense forward, which the integration cannot route through the sampler's replay.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import trl
from accelerate.utils import gather_object
from packaging.version import Version
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from ..config.corrections import CorrectionConfig
from ..config.presets import dense_learner_correction
from ..config.schema import DECODE_FIELDS, KV_STORAGE_FIELDS, SPARSITY_FIELDS, SPECULATIVE_FIELDS, load_config
from ..errors import ConfigError
from ..learner.alpha import alpha_points, rollout_acceptance
from ..learner.corrections import Corrections, compute_corrections
from ..rollout.acceptance import alpha_metrics
from ..rollout.batch import KVStats, RolloutBatch, SamplingConfig
from ..rollout.dispatch.scheduler import RowLimits, request_seed, schedule_rollouts, step_seed
from ..rollout.dispatch.spec import SamplerCache, SamplerSpec
from ..rollout.sparsity.settings import sparsity_from_config
from ..rollout.speculative.drafts import draft_from_config
from ..rollout.speculative.stats import SpeculationStats

# The integration overrides and calls TRL's private methods (`_generate_and_score_completions`,
# `_get_per_token_logps_and_entropies`, `_metrics`), which change between releases.
SUPPORTED_TRL = "1.16"
if Version(trl.__version__).base_version.rsplit(".", 1)[0] != SUPPORTED_TRL:
    raise ImportError(f"sparserl.integrations.trl is built on TRL {SUPPORTED_TRL}'s GRPOTrainer internals; found TRL "
                      f"{trl.__version__}: pip install 'trl=={SUPPORTED_TRL}.*'")

# The rollout settings (`sparserl train`'s names) that the sampler reads.
SAMPLER_SETTINGS = (*SPARSITY_FIELDS, *KV_STORAGE_FIELDS, *SPECULATIVE_FIELDS, *DECODE_FIELDS, "ignore_eos",
                    "alpha_bin_size")
# Where TRL takes the `sparserl train` settings a rollout function does not: said when one is passed to it.
TRL_SETTING_OF = {
    "temperature": "GRPOConfig(temperature=...)", "group_size": "GRPOConfig(num_generations=...)",
    "prompts_per_step": "GRPOConfig(per_device_train_batch_size=..., steps_per_generation=...)",
    "max_new_tokens": "GRPOConfig(max_completion_length=...)", "seed": "GRPOConfig(seed=...)",
    "lr": "GRPOConfig(learning_rate=...)", "steps": "GRPOConfig(max_steps=...)", "kl_coef": "GRPOConfig(beta=...)",
    "clip_eps": "GRPOConfig(epsilon=...)", "clip_eps_high": "GRPOConfig(epsilon_high=...)",
    "minibatches": "GRPOConfig(steps_per_generation=...)", "epochs": "GRPOConfig(num_iterations=...)",
    "loss_agg": "GRPOConfig(loss_type=...)", "entropy_coef": "GRPOConfig(entropy_coef=...)",
    "weight_decay": "GRPOConfig(weight_decay=...)", "grad_clip": "GRPOConfig(max_grad_norm=...)",
    "mode": "SparseGRPOTrainer(correction=...), with SparseRollouts(dense=True) for dense rollouts",
    "chat_template": "the dataset's prompts (chat messages go through the chat template)",
}
# GRPOConfig settings that only TRL's own generation reads (besides every `vllm_*` one, which configures the vLLM
# sampler that SparseRollouts replaces), with the values that leave them off.
TRL_GENERATION_ONLY = {"top_p": (1.0,), "top_k": (0, None, -1), "min_p": (None,), "repetition_penalty": (1.0,),
                       "generation_kwargs": (None, {}), "cache_implementation": (None,), "use_vllm": (False,),
                       "use_transformers_paged": (False,), "use_transformers_continuous_batching": (False,),
                       "transformers_continuous_batching_config": (None,), "ds3_gather_for_generation": (True,),
                       "max_tool_calling_iterations": (None,)}
# Read with use_vllm only, where SparseGRPOTrainer refuses it on; set to False it is what a user of ours means anyway.
_NOT_GENERATION_ONLY = {"vllm_importance_sampling_correction"}


def _generation_only_settings(args) -> list[str]:
    """The settings of `args` (a GRPOConfig) that only TRL's own sampler would read, set away from off."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(args))}
    named = [name for name, off in TRL_GENERATION_ONLY.items() if getattr(args, name, off[0]) not in off]
    vllm = [name for name in defaults if name.startswith("vllm_") and name not in _NOT_GENERATION_ONLY
            and getattr(args, name) != defaults[name]]
    return named + vllm


class SparseRollouts:
    """A `rollout_func` for TRL's `GRPOTrainer` that samples with sparserl.

    Keyword arguments are the sampler's settings, as `sparserl train` names them (`SAMPLER_SETTINGS`: `kv_policy`,
    `kv_budget`, `kv_window`, `kv_interval`, `kv_schedule` (a calibrated schedule file), `sparsity`, `block_*`,
    `kv_dtype`, `speculative`, `speculative_draft`, `draft_tokens`, `rollout_kv_memory`, `max_concurrent_rows`,
    `ignore_eos` (every completion `max_completion_length` long, as benchmarks want), and the policies' own options);
    any other is refused, naming the TRL setting that does its work. `dense=True` samples with the full cache (the
    same engine, no compression; still stored as `kv_dtype` asks). `measure_alpha`: also measure Sparrow's acceptance rate α of each batch against the dense
    policy (a dense forward and, on a large vocabulary, a replay of the sampler), binned by `alpha_bin_size`.
    """

    def __init__(self, dense: bool = False, measure_alpha: bool = False, **rollout: Any):
        _refuse_unread(rollout)
        self.rollout = load_config(None, rollout).rollout  # validated as `sparserl train` validates it
        if self.rollout.kv_schedule == "adaptive":
            raise ConfigError("SparseRollouts: kv_schedule='adaptive' moves the budget between sparserl training "
                              "steps, which TRL does not run; give a calibrated schedule file (`sparserl calibrate`)")
        if dense and self.rollout.speculative:
            raise ConfigError("SparseRollouts: dense=True and speculative=True both ask for dense samples; pass one")
        if measure_alpha and (dense or self.rollout.speculative):
            raise ConfigError("SparseRollouts: measure_alpha compares a sparse sampler with the dense policy; "
                              f"{'dense' if dense else 'speculative'} samples are the dense policy's own (α = 1)")
        self.dense = dense
        self.measure_alpha = measure_alpha
        self.spec = SamplerSpec(
            sparsity=None if dense or self.rollout.speculative else sparsity_from_config(self.rollout),
            draft=draft_from_config(self.rollout) if self.rollout.speculative else None,
            draft_tokens=self.rollout.draft_tokens, record_evictions=False,
            record_distributions=self.measure_alpha, kv_dtype=self.rollout.kv_dtype)
        self.samplers: SamplerCache | None = None
        self._checked: int | None = None  # id of the trainer whose settings were checked

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        if self._checked != id(trainer):
            check_trainer(trainer)
            self._checked = id(trainer)
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
            prompt_width=max(len(p) for p in prompt_ids),
            **RowLimits.from_rollout_config(self.rollout, next(policy.parameters()).device).sampling_fields())
        seeds = generation_seeds(trainer, len(prompt_ids))
        sampler = self.samplers.get(self.spec)
        mode = "train" if trainer.model.training else "eval"
        was_training = policy.training
        policy.eval()
        try:
            batch = schedule_rollouts(sampler, prompt_ids, sampling, seeds)
            alpha = alpha_points(rollout_acceptance(policy, batch, trainer.temperature), batch.response_mask,
                                 batch.prompt_lengths) if self.measure_alpha else None
        finally:
            policy.train(was_training)
        # `take_stats`: the speculative sampler's acceptance figures; None for the engine.
        metrics = _rollout_metrics_over_processes(trainer, batch, sampler.take_stats(), alpha,
                                                  self.rollout.alpha_bin_size)
        for key, value in metrics.items():
            trainer._metrics[mode][f"sparserl/{key}"].append(float(value))
        return _as_lists(batch, prompt_ids)


def _rollout_metrics_over_processes(trainer: GRPOTrainer, batch: RolloutBatch, counted: SpeculationStats | None,
                                    alpha: tuple[torch.Tensor, torch.Tensor] | None, bin_size: int) -> dict[str, float]:
    """The sampler's figures for the generation batch of every process, merged as sparserl merges a step's shards
    (`KVStats.merged`): per-row figures and α pooled over every process's rows (what one process holding them
    logs), speculation counts summed before their ratios are taken, compression events, waves and seconds summed,
    and memory per sampler (the peak and dense-equivalent bytes and rows in flight are the largest process's);
    `rollout_s` is the slowest process's wall time. `counted`: this process's speculation counts (None: not
    speculative); `alpha`: its α points (`alpha_points`, None: not measured)."""
    parts = [(batch.kv, len(batch), batch.rollout_seconds, counted,
              None if alpha is None else tuple(t.cpu() for t in alpha))]
    if trainer.accelerator.num_processes > 1:
        parts = gather_object(parts)
    kv, rows, seconds, counts, alphas = zip(*parts)
    metrics: dict[str, float] = {}
    if alphas[0] is not None:
        metrics.update(alpha_metrics(torch.cat([a for a, _ in alphas]), torch.cat([n for _, n in alphas]), bin_size))
    if counts[0] is not None:
        speculation = SpeculationStats()
        for part in counts:
            speculation.add(part)
        metrics.update(speculation.metrics(bin_size))
    return {**metrics, **KVStats.merged(list(kv), list(rows)).summary(sum(seconds)), "rollout_s": max(seconds)}


def _refuse_unread(rollout: dict[str, Any]) -> None:
    """Refuse a setting the sampler would not read, naming where TRL takes it."""
    for key in rollout:
        if key in SAMPLER_SETTINGS:
            continue
        where = TRL_SETTING_OF.get(key)
        hint = f"in TRL it is {where}" if where else \
            f"it is not a sampler setting (the sampler takes {', '.join(sorted(SAMPLER_SETTINGS))})"
        raise ConfigError(f"SparseRollouts does not take {key!r}: {hint}")


def generation_seeds(trainer: GRPOTrainer, rows: int) -> list[int]:
    """One sampling seed for each of this process's `rows` rows: sparserl's own seed of the row at the same place in
    the whole generation batch (`request_seed(step_seed(seed, step), row)`), numbering every process's rows in turn
    as TRL slices them (each process holds as many), so that no two rows of a step share a seed and one process
    holding the same rows draws the same completions. A step that generates more than once (`steps_per_generation`
    below the gradient accumulation steps) draws each generation batch from its own stream: the micro-step it
    starts at. That count restarts at every optimizer step, as a resumed run restarts it, so a resumed run draws
    the same."""
    micro_step = getattr(trainer, "_step", 0) % max(getattr(trainer, "current_gradient_accumulation_steps", 1), 1)
    seed = step_seed(trainer.args.seed, trainer.state.global_step)
    first = trainer.accelerator.process_index * rows
    return [request_seed(seed, first + row, micro_step) for row in range(rows)]


def check_trainer(trainer: GRPOTrainer) -> None:
    """Refuse the TRL settings a sparserl sampler cannot honour, in one line naming each."""
    args = trainer.args
    set_off = _generation_only_settings(args)
    if set_off:
        raise ConfigError(f"SparseRollouts samples from the whole tempered distribution with sparserl's engine; "
                          f"{', '.join(f'{name}={getattr(args, name)!r}' for name in set_off)} would only shape TRL's "
                          f"own generation: leave {'it' if len(set_off) == 1 else 'them'} at TRL's default")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise ConfigError("SparseRollouts does not run TRL's tool-calling loop (tools=, environment_factory=): its "
                          "post-tool completions would come from TRL's own sampler")
    if trainer.is_fsdp_enabled or (trainer.is_deepspeed_enabled and
                                   trainer.accelerator.state.deepspeed_plugin.zero_stage == 3):
        raise ConfigError("SparseRollouts samples with the trainer's model in each process, whose weights ZeRO-3 and "
                          "FSDP shard: use DDP or ZeRO-1/2")
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


def _as_lists(batch: RolloutBatch, prompt_ids: list[list[int]]) -> dict[str, list]:
    """What TRL's rollout contract asks for: unpadded ids and log-probs, a completion ending at its EOS."""
    lengths = batch.response_lengths.tolist()
    return {"prompt_ids": prompt_ids,
            "completion_ids": [batch.response_ids[i, :n].tolist() for i, n in enumerate(lengths)],
            "logprobs": [batch.sampler_logprobs[i, :n].tolist() for i, n in enumerate(lengths)]}


class SparseGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with a sparserl correction applied to its loss (see the module).

    `correction`: a preset's name (`sparserl presets`: sparse-rl, geo-rs, ...), a preset YAML file (its
    `correction:` fields on its base preset's), or a `CorrectionConfig`. With `dense` (no correction) and a dense
    sampler the loss is TRL's own. The sampler's log-probs must be recorded: `rollout_func=SparseRollouts(...)`,
    another rollout function that returns them, or vLLM with TRL's own correction off
    (`vllm_importance_sampling_correction=False`, so that the two do not stack).
    """

    def __init__(self, *args, correction: str | CorrectionConfig = "sparse-rl", **kwargs):
        # A bad preset fails before TRL loads anything; so does one that trains through the sampler's attention.
        self.correction = dense_learner_correction(correction, "SparseGRPOTrainer")
        super().__init__(*args, **kwargs)
        if isinstance(self.rollout_func, SparseRollouts):
            check_trainer(self)
        elif self.rollout_func is None and not self.args.use_vllm:
            raise ConfigError("SparseGRPOTrainer corrects against the sampler's log-probs, which TRL's own generation "
                              "does not record: pass rollout_func=SparseRollouts(...) (or sample with vLLM)")
        if self.args.use_vllm and self.args.vllm_importance_sampling_correction:
            raise ConfigError("use_vllm=True with vllm_importance_sampling_correction=True would apply TRL's own "
                              "importance correction on top of sparserl's: set vllm_importance_sampling_correction="
                              "False (or drop use_vllm with SparseRollouts)")

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampler = out.get("sampling_per_token_logps")
        if sampler is None:
            raise RuntimeError("the rollout function returned no sampler log-probs to correct against")
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        old = out.get("old_per_token_logps")
        if old is None:  # TRL skips π_old when no optimizer step separates sampling from the loss: the same weights
            old = self._dense_old_logps(out)
        corrections = self._corrections_over_processes(old, sampler, mask)
        out["advantages"] = out["advantages"][:, None] * corrections.weights.to(out["advantages"].dtype)
        out["tool_mask"] = (mask * corrections.keep_mask).to(out["completion_mask"].dtype)
        out["num_items_in_batch"] = self.accelerator.gather(out["tool_mask"].sum()).sum()
        mode = "train" if self.model.training else "eval"
        for key, value in corrections.metrics.items():
            self._metrics[mode][f"sparserl/{key}"].append(float(value))
        return out

    def _corrections_over_processes(self, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> Corrections:
        """The corrections of this process's rows (`[B, T]` each), computed over every process's rows at once, so
        that the batch normalisation, the metrics and their quantiles are the whole generation batch's, as one
        process holding it computes them. Every process holds B rows (TRL slices the batch so), right-padded here
        to the widest process's T."""
        if self.accelerator.num_processes == 1:
            return compute_corrections(old, sampler, mask, self.correction)
        whole = [self.accelerator.gather(self.accelerator.pad_across_processes(part, dim=1))
                 for part in (old, sampler, mask)]
        everything = compute_corrections(*whole, self.correction)
        own = slice(self.accelerator.process_index * len(mask), (self.accelerator.process_index + 1) * len(mask))
        width = mask.shape[1]
        return Corrections(weights=everything.weights[own, :width], keep_mask=everything.keep_mask[own, :width],
                           metrics=everything.metrics, seq_keep=everything.seq_keep[own])

    @torch.no_grad()
    def _dense_old_logps(self, out: dict) -> torch.Tensor:
        """π_old of the batch's completions `[B, T]`: TRL's own forward at the current weights, at its temperature."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, out["completion_ids"].size(1),
                                                                 batch_size=self.args.per_device_train_batch_size)
        return old
