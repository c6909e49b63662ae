"""Training modes as named presets: whether rollouts are sparse, and which corrections apply.

`--mode NAME` picks a built-in preset, or `--mode FILE.yaml` a user's own:

    name: my-geo-rs              # what compare and the report call it (default: the file's stem)
    base: geo-rs                 # optional: start from a built-in preset
    sparse_rollouts: true        # optional when `base` is given
    learner_attention: dense     # optional: dense (the default) or sampler (see below)
    rollout: {kv_dtype: fp8}     # optional: the sampler's kind (sparsity, kv_dtype), unless the run sets it
    correction: {seq_geo_bounds: [0.8, 1.25], is_mode: truncate}

The preset sets every correction field, and the rollout fields that make its sampler what it is (`nemo-fp8`: a
full cache stored as FP8); a field given in the config file or on the command line (`--veto-threshold`,
`--kv-dtype`, ...) overrides it. `sparserl presets` shows each preset's source. `sparse-rl` is the reference and
stays as the paper has it; the `sparrow` preset carries the recommended correction (docs/results.md).

A preset also says what the learner's forwards attend to (`learner_attention`): "dense", the plain causal
forward (π_old, π_θ and π_ref of the full context; the sampler's mismatch is what the corrections correct), or
"sampler", the sparse sampler's own attention by its exact replay (`sparse-learner`, after awslabs' keys_values,
which runs GRPO through an H2O cache in the rollout and the learner alike): the loss's ratio then starts at 1 and
the model is trained for the sparse inference it samples with, so such a preset needs sparse rollouts and corrects
nothing.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError
from .corrections import CorrectionConfig
from .values import coerce


LEARNER_ATTENTIONS = ("dense", "sampler")
# The rollout fields a preset may set: what kind of sampler it is, not how large its budget is.
PRESET_ROLLOUT_FIELDS = ("sparsity", "kv_dtype")


class PresetError(ConfigError):
    pass


@dataclass(frozen=True)
class Preset:
    name: str
    sparse_rollouts: bool  # rollouts with the compressed KV cache, else dense ones
    correction: CorrectionConfig
    summary: str
    needs_schedule: bool = False  # runs under --kv-schedule (a calibrated file; `adaptive` when none is given)
    colour: str | None = None  # its line in the report's plots (None: matplotlib's cycle)
    # What the report's verdicts compare it as: baseline (dense), uncorrected (naive sparse), published
    # (Sparse-RL as its paper runs it), recommended (our choice of correction); "" for the others.
    role: str = ""
    compared_by_default: bool = False  # one of `sparserl compare`'s default --modes
    # What π_old, π_θ (the loss and its gradient) and π_ref attend to: "dense" (the full context) or "sampler" (the
    # sparse sampler's replayed attention: the loss's ratio starts at 1, `learner.sampler_forward`).
    learner_attention: Literal["dense", "sampler"] = "dense"
    # Rollout fields (of PRESET_ROLLOUT_FIELDS) the mode samples with unless the run sets them.
    rollout: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""  # where the recipe comes from ("ours" for this project's own)

    def __post_init__(self) -> None:
        unknown = set(self.rollout) - set(PRESET_ROLLOUT_FIELDS)
        if unknown:
            raise PresetError(f"mode {self.name}: a preset's rollout sets only {', '.join(PRESET_ROLLOUT_FIELDS)}; "
                              f"got {', '.join(sorted(unknown))}")
        if self.rollout and not self.sparse_rollouts:
            raise PresetError(f"mode {self.name}: rollout settings make a sparse sampler, and this preset samples "
                              "densely: set sparse_rollouts: true")
        if self.learner_attention not in LEARNER_ATTENTIONS:
            raise PresetError(f"mode {self.name}: learner_attention must be dense or sampler, "
                              f"got {self.learner_attention!r}")
        if self.learner_attention == "sampler" and not self.sparse_rollouts:
            raise PresetError(f"mode {self.name}: learner_attention sampler trains through the sparse sampler's "
                              "attention, and dense rollouts have none: set sparse_rollouts: true")
        if self.learner_attention == "sampler":
            refuse_corrections(self.name, self.correction)


def corrects(correction: CorrectionConfig) -> bool:
    """Whether `correction` acts at all: some filter on, or importance weights other than ones."""
    filters = (correction.veto_threshold, correction.band, correction.seq_geo_bounds, correction.seq_k3_max,
               correction.seq_log_ratio_max)
    return any(f is not None for f in filters) or correction.is_mode != "none"


def refuse_corrections(mode: str, correction: CorrectionConfig) -> None:
    """A mode whose learner attends as the sampler did has no sampler/learner mismatch to filter or weight."""
    if corrects(correction):
        raise PresetError(f"mode {mode} trains through the sampler's attention, so its loss's ratio is 1 and there is "
                          f"nothing to correct; drop the correction ({describe(correction)})")


def _builtin(name: str, sparse: bool, make: Callable[[], CorrectionConfig], summary: str, colour: str,
             **metadata) -> Preset:
    return Preset(name, sparse, make(), summary, colour=colour, **metadata)


def mode_with_role(role: str) -> str:
    """The built-in mode the report's verdicts treat as `role` (baseline, uncorrected, published, recommended)."""
    return next(name for name, preset in PRESETS.items() if preset.role == role)


# The recommended correction (role="recommended") was chosen on the built-in experiment (docs/results.md,
# "Corrections").
SPARSE_RL = "Sparse-RL (github.com/lsjia/Sparse-RL)"
VERL = "verl's rollout corrections (rollout_rs: geometric mean, seq_mean_k3)"
PRESETS: dict[str, Preset] = {p.name: p for p in (
    _builtin("dense", False, CorrectionConfig.off, "dense rollouts, no correction (the baseline)", "#1f77b4",
             role="baseline", compared_by_default=True, source="GRPO"),
    _builtin("naive-sparse", True, CorrectionConfig.off, "sparse rollouts, no correction", "#d62728",
             role="uncorrected", compared_by_default=True, source=f"{SPARSE_RL}, its uncorrected baseline"),
    _builtin("sparse-rl", True, CorrectionConfig.sparse_rl,
             "Sparse-RL as published: sequence veto 1e-4, band [0.5, 1.5], batch-normalised TIS", "#2ca02c",
             role="published", compared_by_default=True, source=SPARSE_RL),
    _builtin("sparse-tis", True, CorrectionConfig.sparse_tis, "Sparse-RL's importance weights alone", "#ff7f0e",
             source=f"ours: an ablation of {SPARSE_RL}"),
    _builtin("sparse-rs", True, CorrectionConfig.sparse_rs, "Sparse-RL's rejection alone (veto and band)", "#9467bd",
             source=f"ours: an ablation of {SPARSE_RL}"),
    _builtin("geo-rs", True, CorrectionConfig.geo_rs, "verl's Geo-RS: geometric-mean sequence filter plus veto",
             "#e377c2", role="recommended", source=f"{VERL}; bounds ours"),
    _builtin("k3-rs", True, CorrectionConfig.k3_rs, "verl's seq_mean_k3: mean-k3 sequence filter", "#7f7f7f",
             source=f"{VERL}; bound ours"),
    _builtin("seq-mask-tis", True, CorrectionConfig.seq_mask_tis,
             "OpenRLHF/NeMo-RL seq-mask-tis: geometric-mean sequence mask plus token TIS", "#bcbd22",
             source="NeMo-RL's ProRLv2 guide and OpenRLHF (seq-mask-tis); bounds ours"),
    _builtin("prefix-veto-tis", True, CorrectionConfig.prefix_veto_tis,
             "Sparse-RL's TIS with a prefix veto: mask from the first ξ < 1e-4 onward", "#17becf",
             source=f"ours, after {SPARSE_RL}"),
    _builtin("nemo-fp8", True, CorrectionConfig.token_tis,
             "the field's quantized rollouts: nothing evicted, keys and values stored as FP8 (e4m3), token-level "
             "TIS at cap 2; scales here per row from its prompt (NeMo-RL recomputes per-tensor scales each step)",
             "#98df8a", rollout={"sparsity": "none", "kv_dtype": "fp8"},
             source="NeMo-RL pull request 1212 (github.com/NVIDIA-NeMo/RL: FP8 KV cache in GRPO rollouts, "
                    "token-level TIS with C = 2); verl pull request 4435 and slime ship the same"),
    _builtin("sparse-learner", True, CorrectionConfig.off,
             "the learner trains through the sampler's attention (π_old, π_θ and π_ref by its exact replay): the "
             "loss's ratio is 1, nothing to correct; the idea of awslabs' keys_values (H2O in rollout and learner)",
             "#393b79", learner_attention="sampler", source="awslabs/keys_values (GRPO through an H2O cache)"),
)}
RECOMMENDED = mode_with_role("recommended")
PRESETS["sparrow"] = Preset("sparrow", True, PRESETS[RECOMMENDED].correction,
                            f"scheduled sparse rollouts (--kv-schedule) with the recommended correction ({RECOMMENDED})",
                            needs_schedule=True, colour="#8c564b",
                            source="Sparrow (github.com/Infini-AI-Lab/Sparrow): its budget schedule; correction ours")
DEFAULT_COMPARE = tuple(name for name, preset in PRESETS.items() if preset.compared_by_default)


def load_preset(mode: str) -> Preset:
    """A built-in preset by name, or a user's preset from a YAML file."""
    if mode in PRESETS:
        return PRESETS[mode]
    path = Path(mode)
    data = _preset_file(mode, path)
    base = data.get("base")
    if base is not None and base not in PRESETS:
        raise PresetError(f"preset file {path}: base {base!r} is not a built-in preset ({', '.join(PRESETS)})")
    parent = PRESETS[base] if base else None
    if parent is None and "sparse_rollouts" not in data:
        raise PresetError(f"preset file {path}: set sparse_rollouts (true/false) or a base preset")
    overrides = _correction_fields(data, path)
    inherited = parent or Preset("", False, CorrectionConfig.off(), "")  # what a file without a base starts from
    sparse = data.get("sparse_rollouts", inherited.sparse_rollouts)
    if not isinstance(sparse, bool):
        raise PresetError(f"preset file {path}: sparse_rollouts must be true or false, got {sparse!r}")
    try:
        correction = with_fields(inherited.correction, overrides)
    except ConfigError as error:
        raise PresetError(f"preset file {path}: correction: {error}") from None
    rollout = data.get("rollout") or {}
    if not isinstance(rollout, dict):
        raise PresetError(f"preset file {path}: rollout must map {' or '.join(PRESET_ROLLOUT_FIELDS)} to values")
    try:
        return Preset(name=str(data.get("name") or path.stem), sparse_rollouts=sparse, correction=correction,
                      summary=str(data.get("summary", f"user preset from {path}")),
                      needs_schedule=inherited.needs_schedule,
                      learner_attention=data.get("learner_attention", inherited.learner_attention),
                      rollout={**inherited.rollout, **rollout}, source=str(data.get("source", path)))
    except PresetError as error:
        raise PresetError(f"preset file {path}: {error}") from None


def _preset_file(mode: str, path: Path) -> dict:
    """The mapping a preset file holds, its keys checked."""
    if path.suffix not in (".yaml", ".yml"):
        raise PresetError(f"mode {mode!r} is unknown; choose one of {', '.join(PRESETS)} or give a preset YAML file")
    if not path.is_file():
        raise PresetError(f"mode {mode!r}: preset file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise PresetError(f"preset file {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise PresetError(f"preset file {path} must hold a mapping (name, base, sparse_rollouts, correction)")
    allowed = ("name", "base", "sparse_rollouts", "learner_attention", "rollout", "correction", "summary", "source")
    unknown = set(data) - set(allowed)
    if unknown:
        raise PresetError(f"preset file {path}: unknown keys {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(allowed)}")
    return data


def _correction_fields(data: dict, path: Path) -> dict:
    """A preset file's `correction:` mapping, every key a `CorrectionConfig` field."""
    fields = {f.name for f in dataclasses.fields(CorrectionConfig)}
    overrides = data.get("correction") or {}
    if not isinstance(overrides, dict) or set(overrides) - fields:
        bad = sorted(set(overrides) - fields) if isinstance(overrides, dict) else overrides
        raise PresetError(f"preset file {path}: correction must map correction fields to values; unknown: {bad}; "
                          f"fields: {', '.join(sorted(fields))}")
    return overrides


def with_fields(correction: CorrectionConfig, fields: dict[str, Any]) -> CorrectionConfig:
    """`correction` with `fields` (as written in YAML or on a command line) set on top, coerced and validated."""
    hints = typing.get_type_hints(CorrectionConfig)
    given = {key: coerce(value, hints[key], key) for key, value in fields.items()}
    return CorrectionConfig(**{**dataclasses.asdict(correction), **given})


def correction_for(mode: str | CorrectionConfig, fields: dict[str, Any] | None = None) -> CorrectionConfig:
    """The one resolver of a correction: a built-in preset's or a preset file's (its `correction:` fields on its
    base's), with `fields` (a config file's or the flags') on top; a `CorrectionConfig` is taken as it is.
    `sparserl train`, the interop helpers and the TRL integration all ask here."""
    if isinstance(mode, CorrectionConfig):
        if fields:
            raise ValueError("give either a CorrectionConfig or correction fields to set on a preset, not both")
        return mode
    preset = load_preset(mode)
    correction = with_fields(preset.correction, fields or {})
    if preset.learner_attention == "sampler":
        refuse_corrections(preset.name, correction)
    return correction


def dense_learner_correction(mode: str | CorrectionConfig, trainer: str) -> CorrectionConfig:
    """`correction_for(mode)` for another library's trainer (`trainer`), whose loss takes its own dense forward: a
    mode that trains through the sampler's attention cannot be honoured there, and is refused in one line."""
    if not isinstance(mode, CorrectionConfig) and load_preset(mode).learner_attention == "sampler":
        raise PresetError(f"{trainer} cannot run mode {preset_name(mode)}: it trains through the sampler's attention, "
                          f"and {trainer}'s loss takes its own dense forward; use `sparserl train --mode {mode}`")
    return correction_for(mode)


def check_learner_attention(config) -> None:
    """Refuse in one line a run (an `ExperimentConfig`, read by field names) whose mode trains through the sampler's
    attention where there is none to train through, or where a second sampler would hide it."""
    preset = load_preset(config.train.mode)
    if preset.learner_attention != "sampler":
        return
    if config.rollout.speculative:
        raise ConfigError(f"mode {preset.name} trains through the sparse sampler's attention, and --speculative true "
                          "samples exactly from the dense policy (no mismatch, no sparse attention): drop one")
    if config.train.distill_sparse:
        raise ConfigError(f"mode {preset.name} trains the policy itself through the sparse sampler's attention; "
                          "--distill-sparse would sample with an adapter the learner does not see: drop one")
    refuse_corrections(preset.name, config.correction)


def preset_name(mode: str) -> str:
    """What a run of this mode is called in compare's directories and the report."""
    return mode if mode in PRESETS else load_preset(mode).name


def describe(correction: CorrectionConfig) -> str:
    """A one-line account of what a correction config filters and how it weights."""
    parts = []
    if correction.veto_threshold is not None:
        parts.append(f"{correction.veto_scope} veto ξ < {correction.veto_threshold:g}")
    if correction.band is not None:
        parts.append(f"token mask ξ ∉ [{correction.band[0]:g}, {correction.band[1]:g}]")
    if correction.seq_geo_bounds is not None:
        parts.append(f"geometric mean ∉ [{correction.seq_geo_bounds[0]:g}, {correction.seq_geo_bounds[1]:g}]")
    if correction.seq_k3_max is not None:
        parts.append(f"mean k3 > {correction.seq_k3_max:g}")
    if correction.seq_log_ratio_max is not None:
        parts.append(f"max |log ξ| > {correction.seq_log_ratio_max:g}")
    weights = "unit weights" if correction.is_mode == "none" else \
        f"{correction.is_level} IS, {correction.is_mode} at {correction.is_cap:g}" + \
        (", batch-normalised" if correction.batch_normalize else "")
    return ("rejects " + "; ".join(parts) if parts else "no filter") + "; " + weights


def presets_table() -> str:
    """The built-in presets as a Markdown table (`sparserl presets`)."""
    rows = ["| mode | rollouts | corrections | what it is | source |", "|---|---|---|---|---|"]
    for preset in PRESETS.values():
        rollouts = "sparse, scheduled" if preset.needs_schedule else "sparse" if preset.sparse_rollouts else "dense"
        rollouts += "".join(f"; {key} {value}" for key, value in preset.rollout.items())
        if preset.learner_attention == "sampler":
            rollouts += "; learner through the same attention"
        rows.append(f"| `{preset.name}` | {rollouts} | {describe(preset.correction)} | {preset.summary} | "
                    f"{preset.source} |")
    return "\n".join(rows)
