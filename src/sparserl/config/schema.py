"""Typed experiment configuration: dataclass sections, YAML files, and command-line overrides.

A YAML file may be nested by section (`rollout: {kv_budget: 64}`) or flat (`kv_budget: 64`).
Every field is also a command-line flag spelled with dashes (`--kv-budget 64`); field names are
unique across sections so that flags stay short. Unknown keys and wrong types are rejected with
a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError
from ..rollout.sparsity.policies import policy_options
from ..tasks.registry import TASK_OPTIONS
from .corrections import CorrectionConfig
from .presets import PRESETS, correction_for, load_preset
from .validation import validate
from .values import coerce

MODES: tuple[str, ...] = tuple(PRESETS)


@dataclass
class ModelConfig:
    model: str | None = None  # a Hugging Face model directory (or a run directory or checkpoint, for eval); none: the built-in model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights' dtype (log-probs, ratios and α are float32)
    device: str = "auto"  # where the model runs: auto (cuda when present, else cpu), cpu, cuda or cuda:N
    threads: int | Literal["auto"] = "auto"  # torch CPU threads: auto (1 for a small model, else the free cores; a resumed run keeps its count), a count, or 0 for torch's default


@dataclass
class TaskConfig:
    task: str = "pointer_walk"  # a registered task (tasks/), or gym:<dataset>
    chat_template: bool = False  # put each prompt to the model as one user turn of its tokenizer's chat template (instruction-tuned models)
    max_new_tokens: int = 0  # response bound in tokens; 0 = the task's own


# Each task's own options (pointer_walk's difficulty, math_jsonl's data_path, ...) are declared where the task
# is registered (`tasks/`); TaskConfig gains one field per option, with the task's default and help.
TaskConfig = dataclasses.make_dataclass(
    "TaskConfig", [(o.key, o.annotation, field(default=o.default, metadata={"help": o.help}))
                   for o in TASK_OPTIONS.values()], bases=(TaskConfig,))
TaskConfig.__module__ = __name__


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8  # prompts per training step
    group_size: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0  # sampling temperature (no top-p or top-k); the correction filters' defaults are the reference's at T = 1 (on SmolLM2's warm start the band touched 66% of sequences at T = 0.5, 78% at 1.0: docs/modes.md)
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    kv_policy: str = "rkv"  # which cached tokens a sparse rollout keeps: rkv | snapkv | h2o | streamingllm | pyramidkv
    kv_budget: int = 80  # KV tokens kept per layer; 80 is the built-in experiment's paper regime, 56 its stress regime
    kv_window: int = 8  # most recent tokens always kept (the observation window)
    kv_interval: int = 8  # decode steps between compressions
    kv_schedule: str | None = None  # a budget schedule YAML (from `sparserl calibrate`), or adaptive: kv_budget adjusted online to keep the α tail >= alpha_tau
    alpha_bin_size: int = 16  # cached-length bin (tokens) over which the α tail of sparse rollouts is measured
    alpha_tau: float = 0.86  # the α tail an adaptive schedule, or a recalibration, keeps
    alpha_every: int = 1  # train: measure α of sparse rollouts at step 1 and every N steps after (0: never); it reuses π_old's forward and, on a large vocabulary, replays the sampler (SmolLM2 word additions: about 4 s of a 35 s step). An adaptive schedule reads it every step
    recalibrate_every: int = 0  # train: rerun the calibration on the current weights every N steps (0: never); tau alpha_tau, bins alpha_bin_size
    calibration_budgets: str = "24,32,40,48,56,64,72,80,96,128"  # the budgets a recalibration tries, comma-separated
    calibration_prompts: int = 16  # train prompts per recalibration (drawn with the step's seed)
    calibration_samples: int = 4  # sampled rollouts per calibration prompt
    kv_per_head: bool = False  # false: one kept set per layer, scores summed over KV heads (reference); true: per head
    kv_dtype: Literal["auto", "fp8", "int8"] = "auto"  # how the rollout's KV cache stores keys and values, alone or under any KV policy: auto (the model's dtype), fp8 (e4m3, a scale per layer and KV head fixed per rollout from the prompt) or int8 (KIVI: keys per channel, values per token); 1 byte an element, half a bf16 cache. The batch records its scales, so the learner's replay (alpha, DistillSparse) stays exact; not with block sparsity or speculative rollouts
    sparsity: Literal["eviction", "block", "none"] = "eviction"  # eviction: the KV policy drops tokens (saves memory); block: full KV kept, each decode step attends to kv_budget tokens in 16-token pages (saves attention reads); none: every token kept and attended, so the sampler differs from dense only by its storage (--kv-dtype fp8|int8: a quantized full cache, as mode nemo-fp8 runs it)
    block_page_size: int = 16  # block: tokens per page
    block_dense_layers: int = 2  # block: the first layers attend densely
    speculative: bool = False  # lossless rollouts: a sparse draft (speculative_draft, kv_budget) proposes draft_tokens tokens, the dense model verifies them. Buys exact dense samples, so no mismatch to correct; costs speed: measured at 0.16-0.27x dense's tokens/s on one H200 (4096-8192 tokens, 64-512 rows) and 0.69-1.12x by CPU time on a 2-core CPU (1024-4096 tokens, 32 rows), docs/benchmarks.md
    speculative_draft: str = "block"  # speculative (rollout/speculative/drafts/): the draft reads block-sparse pages (kv_budget, block_*) or a window of kv_budget slots (the first min(64, kv_budget / 4) and the most recent)
    draft_tokens: int | Literal["adaptive"] = 4  # speculative: tokens drafted per verification, or adaptive (1-8, from the running acceptance rate and step costs)
    rollout_workers: int = 0  # Ray actors that sample rollouts (0: in this process); needs pip install -e ".[ray]"
    rollout_backend: str = "auto"  # where a step's shards are sampled (rollout/dispatch/): auto (ray with --rollout-workers, else local), local or ray
    rollout_shards: int = 0  # fixed sets of prompt groups each sampled as one batch with its own seed; 0 = max(1, rollout_workers). Same shards, same metrics, whatever the workers
    ray_address: str | None = None  # join this Ray cluster (e.g. auto or ray://host:10001); none: start a local one
    rollout_timeout: float = 600.0  # seconds a worker may take for one shard before it is replaced and the shard retried
    worker_gpus: float = 0.0  # GPUs each rollout worker asks Ray for on a CUDA device (fractions colocate); 0 = 1 / rollout_workers
    worker_cpus: int = 1  # CPUs each rollout worker asks Ray for; a worker samples with the driver's torch thread count (so its shards are bit for bit the in-process ones), so give it at least that many
    rollout_kv_memory: str | None = None  # KV memory for the rows in flight: a size (64MiB, 20GiB) or auto (90% of the memory free after the weights); each row reserves what its cache can reach, so a compressed sampler runs more rows in the same bytes; none: no limit
    max_concurrent_rows: int = 0  # the most rows decoding at once (0: the whole step, or what --rollout-kv-memory holds)
    compile_decode: Literal["auto", "true", "false"] = "auto"  # how the static decode step runs: auto (CUDA graphs on a GPU, eager elsewhere), true (torch.compile, then on a GPU the compiled step captured as graphs: slow to start, changes float rounding only), false (eager)


# The KV policies' options (kv_lambda, kv_sinks, ...) are fields of the policies themselves
# (`rollout/sparsity/policies/`); RolloutConfig gains one field per option, with the policy's default and help.
RolloutConfig = dataclasses.make_dataclass(
    "RolloutConfig", [(o.key, o.annotation, field(default=o.default, metadata={"help": o.help}))
                      for o in policy_options().values()], bases=(RolloutConfig,))
RolloutConfig.__module__ = __name__

# Rollout settings grouped by what reads them, so that a command or an integration takes the groups it honours and
# no other flag: the sparse sampler's (KV eviction or block attention, each KV policy's own options), the limits on
# rows decoding at once and how the decode step runs, and the lossless speculative sampler's.
SPARSITY_FIELDS = ("sparsity", "kv_policy", "kv_budget", "kv_window", "kv_interval", "kv_schedule", "kv_per_head",
                   "block_page_size", "block_dense_layers", *policy_options())
DECODE_FIELDS = ("rollout_kv_memory", "max_concurrent_rows", "compile_decode")
# How the rollout's cache stores keys and values (a quantized cache changes what is sampled): read by training, the
# TRL integration and the inference commands (eval's and calibrate's sparse sampler; sweep tries a list of them).
KV_STORAGE_FIELDS = ("kv_dtype",)
SPECULATIVE_FIELDS = ("speculative", "speculative_draft", "draft_tokens")


@dataclass
class TrainConfig:
    mode: str = "dense"  # a preset: whether rollouts are sparse and which corrections apply (`sparserl presets`), or a preset YAML file
    steps: int = 80  # training steps (one rollout batch each)
    seed: int = 0  # prompts, sampling and held-out set all derive from it
    lr: float = 1e-4  # AdamW learning rate; tuned on the built-in experiment (1e-3 collapsed, 3e-4 stayed flat)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clip
    minibatches: int = 2  # optimizer steps per rollout batch
    epochs: int = 1  # passes over each rollout batch
    clip_eps: float = 0.2  # PPO clip, lower side
    clip_eps_high: float = 0.2  # PPO clip, upper side
    kl_coef: float = 1e-4  # weight of the k3 KL to the initial policy (0: no reference model)
    entropy_coef: float = 0.0  # weight of the entropy bonus
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"  # loss aggregation (token-mean: DAPO)
    rejected_in_baseline: bool = True  # rejected sequences still count in their group's reward baseline (reference)
    warn_rejected_frac: float = 0.5  # warn once when corrections reject more than this fraction of tokens
    max_rejected_steps: int = 3  # stop with an error after this many consecutive steps whose every token was rejected
    micro_batch_size: int = 64  # rows per forward in recompute and update; bounds memory
    share_prompts: bool = True  # the learner's forwards (pi_old, pi_ref, the update, alpha, DistillSparse) compute each group's prompt once for its G responses (Prefix Grouper: the same log-probs and gradients); false: every row's prompt again
    distill_sparse: bool = False  # DistillSparse: a LoRA active only in the sparse sampler, trained toward the dense policy
    distill_rank: int = 8  # DistillSparse LoRA rank
    distill_alpha: float = 16.0  # DistillSparse LoRA alpha (scale alpha / rank)
    distill_lr: float = 1e-4  # DistillSparse adapter learning rate (AdamW)
    distill_kl_coef: float = 1.0  # weight λ of KL(dense ‖ sparse) in the adapter's loss
    distill_target_modules: str = "all-linear"  # layers the adapter wraps: all-linear, or comma-separated module names
    reward_funcs: str = "task"  # comma-separated rewards: task (the task's own) and MODULE:FUNCTION or FILE.py:FUNCTION
    reward_weights: str = ""  # comma-separated weights, one per reward function (default: all 1)
    reward_timeout: float = 10.0  # seconds a reward function may take for one batch before its worker is killed
    max_reward_failure_frac: float = 0.5  # stop the run when more completions than this fail in one reward function


@dataclass
class OutputConfig:
    out: str = "runs/default"  # the run directory
    checkpoint_every: int = 10  # steps between checkpoints (and one at the end, and on Ctrl-C)
    keep_checkpoints: int = 2  # newest checkpoints kept (>= 1)
    eval_every: int = 10  # steps between held-out evaluations (0: none)
    eval_examples: int = 200  # held-out prompts per evaluation
    eval_sparse_inference: bool = False  # also evaluate under this run's KV cache (compare always does)
    log_with: str = "tensorboard"  # comma-separated: tensorboard, trackio, wandb, none


@dataclass
class WarmupConfig:
    """`sparserl warmup`: the supervised warm start of the built-in model (see `sparserl.experiments.warmup`)."""

    out: str = "warmup-model"  # where the model directory is written
    overwrite: bool = False  # replace --out if it exists (else the command refuses before training)
    seed: int = 0  # model initialisation and the demonstration stream
    letters: int = 26  # the target task's difficulty (longest cycle)
    batch_size: int = 32  # demonstrations per step
    lr: float = 2e-3  # AdamW learning rate
    warmup_steps: int = 50  # linear learning-rate warm-up
    weight_decay: float = 0.01  # AdamW weight decay
    max_steps: int = 12000  # give up after this many steps
    probe_every: int = 25  # steps between probes in the early stages
    final_probe_every: int = 10  # steps between probes in the last (target) stage
    stage_probe_examples: int = 64  # prompts per early-stage probe
    probe_examples: int = 200  # held-out target prompts per last-stage probe
    band_low: float = 0.30  # the band of held-out exact walks a shipped model must be in
    band_high: float = 0.80  # (upper end)
    stop_at: float = 0.50  # stop at the first probe in the band at or above this
    # Early stages: (min letters, max letters, exact-walk rate at this stage that moves on); the
    # target distribution follows as the last stage.
    curriculum: list[tuple[int, int, float]] = field(
        default_factory=lambda: [(3, 8, 0.9), (3, 14, 0.9)])
    threads: int = 1  # torch threads (fixed, so that the same seed gives the same weights)

    def __post_init__(self) -> None:
        _check_warm_start(self, ("batch_size", "warmup_steps", "max_steps", "probe_every", "final_probe_every",
                                 "stage_probe_examples", "probe_examples", "threads", "letters"))
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay} must be >= 0")


@dataclass
class SFTConfig:
    """`sparserl sft`: a short supervised warm start of a model on a task's demonstrations (`experiments/sft.py`).
    A config file sets these under `sft:`."""

    out: str = "sft-model"  # where the warm-started model directory is written
    overwrite: bool = False  # replace --out if it exists (else the command refuses before training)
    steps: int = 300  # the most optimizer steps
    batch_size: int = 8  # demonstrations per step (fresh training examples every step)
    lr: float = 5e-5  # AdamW learning rate
    warmup_steps: int = 10  # linear learning-rate warm-up
    probe_every: int = 20  # steps between held-out greedy probes
    probe_examples: int = 40  # held-out prompts per probe
    band_low: float = 0.15  # the band of held-out greedy accuracy the kept model must be in (RL needs room)...
    band_high: float = 0.6  # ...(upper end)
    stop_at: float = 0.15  # stop at the first probe in the band at or above this

    def __post_init__(self) -> None:
        _check_warm_start(self, ("steps", "batch_size", "warmup_steps", "probe_every", "probe_examples"))


@dataclass(frozen=True)
class Band:
    """Held-out greedy accuracy a warm-started model must have: in [low, high], stopping at the first probe at or
    above `stop_at` (`experiments.supervised`)."""

    low: float
    high: float
    stop_at: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.stop_at <= self.high <= 1.0:
            raise ConfigError(f"the accuracy band must satisfy 0 <= --band-low ({self.low}) <= --stop-at "
                              f"({self.stop_at}) <= --band-high ({self.high}) <= 1: a stop outside the band can "
                              "never be reached")


def _check_warm_start(settings, counts: tuple[str, ...]) -> None:
    """A warm start's settings, each named by its flag: counts of at least 1, a positive learning rate, and a band
    whose stop lies inside it."""
    for name in counts:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be an integer >= 1")
    if not settings.lr > 0:
        raise ConfigError(f"--lr {settings.lr!r} must be > 0")
    Band(settings.band_low, settings.band_high, settings.stop_at)


def field_help(cls: type) -> dict[str, str]:
    """The trailing `# comment` of each field in `cls`'s source: the field's one-line --help."""
    import inspect
    import re

    pattern = re.compile(r"^\s+(\w+):[^#]*#\s*(.+)$")
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}
    for klass in (k for k in cls.__mro__ if k.__module__ == cls.__module__ and k.__qualname__ == k.__name__):
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue  # made by make_dataclass: its help is in the fields' metadata
        helps.update({m.group(1): m.group(2) for line in lines if (m := pattern.match(line))})
    return helps


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig.off)  # the default mode's (dense) preset
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _sections(cls: type = ExperimentConfig) -> dict[str, type]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def field_index() -> dict[str, tuple[str, Any, Any]]:
    """leaf name -> (section, type, default) over all sections."""
    index = {}
    for section, section_cls in _sections().items():
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if f.name in index:
                raise AssertionError(f"config field {f.name} appears in two sections")
            index[f.name] = (section, hints[f.name], default)
    return index


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Defaults, then the YAML file, then `overrides` (leaf name -> value, e.g. from the CLI)."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(read_yaml(Path(path)))
    values.update({k: v for k, v in (overrides or {}).items()})
    index = field_index()
    sections: dict[str, dict[str, Any]] = {name: {} for name in _sections()}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in index:
            if isinstance(raw, dict):  # a mapping under an unknown name: a misspelt section
                close = difflib.get_close_matches(name, list(_sections()), n=3, cutoff=0.6)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown config section {key!r}{hint}; the sections are "
                                  f"{', '.join(_sections())}")
            close = difflib.get_close_matches(name, list(index), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; `sparserl train --help` lists them all")
        section, annotation, _ = index[name]
        sections[section][name] = coerce(raw, annotation, name)
    # A preset's sampler (nemo-fp8: a full cache stored as FP8) unless the file or the flags set those fields.
    preset = load_preset(sections["train"].get("mode", TrainConfig.mode))
    for name, value in preset.rollout.items():
        sections["rollout"].setdefault(name, coerce(value, index[name][1], name))
    try:
        built = {name: cls(**sections[name]) for name, cls in _sections().items() if name != "correction"}
        built["correction"] = correction_for(built["train"].mode, sections["correction"])
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    config = ExperimentConfig(**built)
    if preset.needs_schedule and not config.rollout.kv_schedule \
            and not config.rollout.recalibrate_every:
        # A scheduled mode with neither a calibrated file nor recalibration adapts its budgets online.
        config.rollout.kv_schedule = "adaptive"
    validate(config)
    return config


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    flat: dict[str, Any] = {}
    section_names = _sections()
    for key, value in data.items():
        # `task` and `model` are both section and field names: a mapping is the section, a scalar the field.
        if key in section_names and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


# Training settings that only another one turns on: (the setting that turns them on, the settings it turns on, whether
# they are on, what turns them on said as flags). Set away from their default while off, nothing would read them:
# `check_training_settings` refuses that. Inference commands read some of them on their own terms (calibrate's
# calibration_*), so `validate` does not.
DEPENDENT_SETTINGS: tuple[tuple[str, tuple[str, ...], Callable[[ExperimentConfig], bool], str], ...] = (
    ("speculative", ("speculative_draft", "draft_tokens"), lambda c: c.rollout.speculative, "--speculative true"),
    ("sparsity", ("block_page_size", "block_dense_layers"),
     lambda c: c.rollout.sparsity == "block" or (c.rollout.speculative and c.rollout.speculative_draft == "block"),
     "--sparsity block or a block-sparse speculative draft"),
    ("sparsity", ("kv_policy", *policy_options()), lambda c: c.rollout.sparsity == "eviction",
     "--sparsity eviction (block-sparse attention evicts nothing)"),
    ("recalibrate_every", ("calibration_budgets", "calibration_prompts", "calibration_samples"),
     lambda c: c.rollout.recalibrate_every > 0, "--recalibrate-every N"),
    ("rollout_workers", ("ray_address", "rollout_timeout", "worker_gpus", "worker_cpus"),
     lambda c: c.rollout.rollout_workers > 0, "--rollout-workers N"),
    ("distill_sparse", ("distill_rank", "distill_alpha", "distill_lr", "distill_kl_coef", "distill_target_modules"),
     lambda c: c.train.distill_sparse, "--distill-sparse true"),
)


def check_training_settings(config: ExperimentConfig) -> None:
    """Refuse a training run's setting that nothing would read (`DEPENDENT_SETTINGS`), naming what turns it on."""
    index = field_index()
    for _, names, turned_on, by in DEPENDENT_SETTINGS:
        if turned_on(config):
            continue
        for name in names:
            section, _, default = index[name]
            if getattr(getattr(config, section), name) != default:
                raise ConfigError(f"--{name.replace('_', '-')} does nothing without {by}; set that too, or leave "
                                  f"--{name.replace('_', '-')} out")


def switched_off(*settings: str) -> dict[str, Any]:
    """Overrides that turn `settings` (DEPENDENT_SETTINGS' first names) off, with every setting they turn on back at
    its default: what `compare` gives its dense baseline, which runs no DistillSparse and no recalibration."""
    index = field_index()
    names = [name for enabler, dependents, _, _ in DEPENDENT_SETTINGS if enabler in settings
             for name in (enabler, *dependents)]
    return {name: index[name][2] for name in names}


def save_config(config: ExperimentConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(_plain(config.to_dict()), sort_keys=False))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value
