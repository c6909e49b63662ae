"""Typed experiment configuration: dataclass sections, YAML files, and command-line overrides.

A YAML file may be nested by section (`rollout: {kv_budget: 64}`) or flat (`kv_budget: 64`).
Every field is also a command-line flag spelled with dashes (`--kv-budget 64`); field names are
unique across sections so that flags stay short. Unknown keys and wrong types are rejected with
a `ConfigError` naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .corrections import CorrectionConfig

Mode = Literal["dense", "naive-sparse", "sparse-rl", "sparse-tis", "sparse-rs"]
MODES: tuple[str, ...] = typing.get_args(Mode)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is allowed."""


@dataclass
class ModelConfig:
    model: str | None = None  # a Hugging Face model directory; None = the built-in warm-started model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int = 0  # torch CPU threads; 0 keeps torch's default


@dataclass
class TaskConfig:
    task: str = "pointer_walk"  # pointer_walk | math_jsonl | reasoning_gym
    difficulty: int = 12  # pointer_walk: letters in the cycle (2..26)
    hops: int = 32  # pointer_walk: steps in the chain of thought
    data_path: str | None = None  # math_jsonl: the JSONL file
    prompt_key: str = "prompt"
    label_key: str = "label"
    template: str = "{prompt}"
    gym_dataset: str = "chain_sum"  # reasoning_gym: dataset name
    max_new_tokens: int = 0  # 0 = the task's own response bound


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    kv_policy: str = "rkv"
    kv_budget: int = 56
    kv_window: int = 8
    kv_interval: int = 8
    kv_per_head: bool = False  # False: one kept set per layer, scores summed over KV heads (reference)
    kv_lambda: float = 0.1  # R-KV: weight of importance against redundancy
    kv_similarity_threshold: float = 0.5  # R-KV: key cosine similarity above which the older twin is redundant
    kv_kernel_size: int = 7  # SnapKV, R-KV, PyramidKV: 1-D pooling kernel over positions (odd)
    kv_pooling: Literal["max", "mean"] = "max"  # SnapKV, R-KV, PyramidKV: pooling over query heads and positions
    kv_sinks: int = 4  # StreamingLLM: attention-sink tokens always kept


@dataclass
class TrainConfig:
    mode: Mode = "dense"
    steps: int = 60
    seed: int = 0
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 2  # optimizer steps per rollout batch
    epochs: int = 1
    clip_eps: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 1e-4
    entropy_coef: float = 0.0
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    rejected_in_baseline: bool = True
    warn_rejected_frac: float = 0.5
    micro_batch_size: int = 64  # rows per forward in recompute and update; bounds memory


@dataclass
class OutputConfig:
    out: str = "runs/default"
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    eval_every: int = 10
    eval_examples: int = 200
    # Also evaluate under sparse inference (this run's KV settings) on eval steps; `compare` always does.
    eval_sparse_inference: bool = False
    log_with: str = "tensorboard"  # comma-separated: tensorboard, trackio, wandb, none


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
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


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert `value` (from YAML or a command line string) to `annotation`, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if errors else f"{key}: {value!r} is not allowed")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(coerce(v, a, key) for v, a in zip(items, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(as_float)
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {annotation}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Defaults, then the YAML file, then `overrides` (leaf name -> value, e.g. from the CLI)."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(Path(path)))
    values.update({k: v for k, v in (overrides or {}).items()})
    index = field_index()
    sections: dict[str, dict[str, Any]] = {name: {} for name in _sections()}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in index:
            close = difflib.get_close_matches(name, list(index), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; `sparserl train --help` lists them all")
        section, annotation, _ = index[name]
        sections[section][name] = coerce(raw, annotation, name)
    try:
        built = {name: cls(**sections[name]) for name, cls in _sections().items()}
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    config = ExperimentConfig(**built)
    validate(config)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
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


def validate(config: ExperimentConfig) -> None:
    """Cross-field checks that the types alone cannot express."""
    checks = [
        (config.rollout.group_size >= 2, "group_size must be >= 2 (GRPO needs a group to compare)"),
        (config.rollout.prompts_per_step >= 1, "prompts_per_step must be >= 1"),
        (config.rollout.kv_window >= 1, "kv_window must be >= 1"),
        (config.rollout.kv_budget > config.rollout.kv_window,
         f"kv_budget ({config.rollout.kv_budget}) must exceed kv_window ({config.rollout.kv_window})"),
        (config.rollout.kv_interval >= 1, "kv_interval must be >= 1"),
        (config.rollout.temperature > 0, "temperature must be > 0 for RL sampling"),
        (config.train.steps >= 0, "steps must be >= 0"),
        (config.train.lr > 0, "lr must be > 0"),
        (config.train.minibatches >= 1, "minibatches must be >= 1"),
        (config.train.epochs >= 1, "epochs must be >= 1"),
        (0 < config.train.clip_eps < 1, "clip_eps must be in (0, 1)"),
        (config.train.clip_eps_high > 0, "clip_eps_high must be > 0"),
        (config.train.kl_coef >= 0, "kl_coef must be >= 0"),
        (config.output.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
        (config.task.difficulty >= 2, "difficulty must be >= 2"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    total = config.rollout.prompts_per_step * config.rollout.group_size
    if total % config.train.minibatches:
        raise ConfigError(f"minibatches ({config.train.minibatches}) must divide prompts_per_step x group_size ({total})")


def add_config_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per config field, grouped by section, showing its default and type."""
    index = field_index()
    groups = {name: parser.add_argument_group(f"{name} settings") for name in _sections()}
    for name, (section, annotation, default) in index.items():
        if name in skip:
            continue
        groups[section].add_argument(
            "--" + name.replace("_", "-"), dest=f"cfg__{name}", default=None, metavar=_metavar(annotation),
            help=f"(default: {default})")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__") and v is not None}


def _metavar(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    names = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}
    if annotation in names:
        return names[annotation]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:
        return _metavar(args[0]) if len(args) == 1 else "VALUE"
    return "VALUE"


def save_config(config: ExperimentConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(_plain(config.to_dict()), sort_keys=False))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value
