"""Configuration: defaults, YAML (nested and flat), overrides, type and cross-field errors, round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparserl.config.schema import (
    ConfigError,
    ExperimentConfig,
    load_config,
    save_config,
)


def _write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- defaults
def test_defaults_match_the_spec_reference_values():
    config = load_config(overrides={"mode": "sparse-rl"})
    # The published Sparse-RL values: the sparse-rl preset.
    assert config.correction.veto_threshold == 1e-4 and config.correction.veto_scope == "sequence"
    assert config.correction.band == (0.5, 1.5)
    assert config.correction.is_mode == "truncate"
    assert config.correction.is_cap == 1.5
    assert config.correction.is_level == "token"
    assert config.correction.batch_normalize is True
    assert config.train.clip_eps == 0.2
    assert config.train.kl_coef == 1e-4
    assert config.train.entropy_coef == 0.0
    assert config.train.loss_agg == "seq-mean-token-mean"
    assert config.rollout.temperature == 1.0
    assert config.rollout.group_size == 8
    # Project defaults (the laptop experiment of the README).
    assert load_config().train.mode == "dense"
    # The built-in experiment's paper regime, measured by `sparserl sweep` (docs/results.md); its config
    # file must agree with the default.
    assert config.rollout.kv_budget == 80
    assert load_config(Path(__file__).parents[1] / "configs" / "paper-regime.yaml").rollout.kv_budget == 80
    assert load_config(Path(__file__).parents[1] / "configs" / "stress-regime.yaml").rollout.kv_budget == 56
    assert config.rollout.kv_window == 8
    assert config.rollout.kv_interval == 8
    assert config.rollout.kv_per_head is False
    assert config.task.task == "pointer_walk"
    assert config.model.model is None
    # load_config() with nothing equals a freshly built dataclass.
    assert load_config() == ExperimentConfig()


# ----------------------------------------------------------------------------- YAML
def test_yaml_nested_by_section(tmp_path):
    path = _write(tmp_path, "rollout:\n  kv_budget: 64\n  kv_per_head: true\n"
                            "train:\n  mode: sparse-rl\n  steps: 5\n"
                            "correction:\n  band: [0.6, 1.4]\n  veto_threshold: null\n")
    config = load_config(path)
    assert config.rollout.kv_budget == 64
    assert config.rollout.kv_per_head is True
    assert config.train.mode == "sparse-rl"
    assert config.train.steps == 5
    assert config.correction.band == (0.6, 1.4)
    assert config.correction.veto_threshold is None
    # Untouched fields keep their defaults.
    assert config.rollout.kv_window == 8


def test_yaml_flat(tmp_path):
    path = _write(tmp_path, "kv_budget: 48\nmode: naive-sparse\nlr: 0.001\nband: '0.7,1.3'\n")
    config = load_config(path)
    assert config.rollout.kv_budget == 48
    assert config.train.mode == "naive-sparse"
    assert config.train.lr == 0.001
    assert config.correction.band == (0.7, 1.3)


@pytest.mark.parametrize("text, check", [
    ("task: math_jsonl\ndata_path: x.jsonl\n", lambda c: c.task.task == "math_jsonl"),
    ("model: /some/model/dir\n", lambda c: c.model.model == "/some/model/dir"),
])
def test_yaml_flat_keys_named_like_a_section(tmp_path, text, check):
    assert check(load_config(_write(tmp_path, text)))


def test_overrides_beat_yaml(tmp_path):
    path = _write(tmp_path, "rollout:\n  kv_budget: 64\ntrain:\n  steps: 5\n")
    config = load_config(path, {"kv_budget": "128", "kv-window": 4})
    assert config.rollout.kv_budget == 128  # CLI strings are coerced
    assert config.rollout.kv_window == 4  # dashes are accepted
    assert config.train.steps == 5  # the YAML value the overrides left alone


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = _write(tmp_path, "rollout: [1, 2\n", "bad.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    not_mapping = _write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(not_mapping)


# ----------------------------------------------------------------------------- errors
def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"kv_buget": 3})
    message = str(info.value)
    assert "kv_buget" in message
    assert "kv_budget" in message  # the near miss
    with pytest.raises(ConfigError, match="kv_bugdet"):
        load_config(_write(tmp_path, "rollout:\n  kv_bugdet: 3\n"))


def test_a_misspelt_section_is_named_as_a_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section 'rolout' \(did you mean rollout\?\); the sections "
                                          r"are .*rollout"):
        load_config(_write(tmp_path, "rolout:\n  kv_budget: 12\n"))


@pytest.mark.parametrize("typo, meant", [("stpes", "steps"), ("kvbudget", "kv_budget")])
def test_unknown_key_suggests_close_spellings(typo, meant):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={typo: 1})
    assert meant in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("kv_budget", "abc"),
    ("kv_budget", True),
    ("steps", 1.5),
    ("steps", "1.5"),
    ("kv_per_head", "maybe"),
    ("kv_per_head", 3),
    ("mode", "bogus"),
    ("loss_agg", "mean"),
    ("band", "0.5"),
    ("band", "0.5,x"),
    ("band", "1.5,0.5"),  # low > high
    ("lr", "fast"),
    ("veto_threshold", "abc"),
    ("veto_threshold", 0),  # must be > 0 or None
    ("is_mode", "squash"),
    ("out", {"a": 1}),
])
def test_wrong_types_name_the_key(key, value):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: value})
    assert key in str(info.value)


def test_wrong_type_from_yaml_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="kv_budget"):
        load_config(_write(tmp_path, "rollout:\n  kv_budget: abc\n"))
    with pytest.raises(ConfigError, match="steps"):
        load_config(_write(tmp_path, "steps: 1.5\n"))


@pytest.mark.parametrize("raw, expected", [
    ("0.6,1.4", (0.6, 1.4)),
    (" 0.6 , 1.4 ", (0.6, 1.4)),
    ("none", None),
    ("None", None),
    (None, None),
    ([0.25, 2], (0.25, 2.0)),
])
def test_band_parsing(raw, expected):
    assert load_config(overrides={"band": raw}).correction.band == expected


@pytest.mark.parametrize("raw", ["none", "null", None])
def test_veto_threshold_none(raw):
    assert load_config(overrides={"veto_threshold": raw}).correction.veto_threshold is None


@pytest.mark.parametrize("raw, expected", [("true", True), ("off", False), ("1", True), (False, False)])
def test_bool_spellings(raw, expected):
    assert load_config(overrides={"kv_per_head": raw}).rollout.kv_per_head is expected


def test_integers_accept_integral_floats_and_strings():
    config = load_config(overrides={"steps": "7", "kv_budget": 64.0})
    assert config.train.steps == 7 and isinstance(config.train.steps, int)
    assert config.rollout.kv_budget == 64 and isinstance(config.rollout.kv_budget, int)


# ----------------------------------------------------------------------------- cross-field
@pytest.mark.parametrize("overrides, names", [
    ({"kv_budget": 8, "kv_window": 8}, ("kv_budget", "kv_window")),
    ({"kv_budget": 4, "kv_window": 8}, ("kv_budget", "kv_window")),
    ({"group_size": 1}, ("group_size",)),
    # 3 prompts x 2 samples = 6 rows; 4 minibatches do not divide them.
    ({"prompts_per_step": 3, "group_size": 2, "minibatches": 4}, ("minibatches", "prompts_per_step", "group_size")),
    ({"temperature": 0}, ("temperature",)),
    ({"clip_eps": 1.0}, ("clip_eps",)),
    ({"kl_coef": -1}, ("kl_coef",)),
    ({"weight_decay": -0.1}, ("weight_decay",)),
    ({"grad_clip": 0}, ("grad_clip",)),
    ({"entropy_coef": -0.01}, ("entropy_coef",)),
    ({"warn_rejected_frac": 1.5}, ("warn_rejected_frac",)),
    ({"threads": -1}, ("threads",)),
    ({"threads": "many"}, ("threads",)),
    ({"mode": "geo-rs", "distill_sparse": True, "distill_alpha": 0}, ("distill_alpha",)),
])
def test_cross_field_errors_name_the_fields(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    for name in names:
        assert name in str(info.value)


def test_minibatches_that_divide_are_fine():
    # 3 x 2 = 6 rows: 1, 2, 3 and 6 minibatches divide them.
    for minibatches in (1, 2, 3, 6):
        load_config(overrides={"prompts_per_step": 3, "group_size": 2, "minibatches": minibatches})


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("overrides", [
    {},
    {"band": "none", "veto_threshold": "none", "mode": "sparse-rl", "model": "/tmp/m", "kv_per_head": True,
     "lr": 1e-6, "loss_agg": "token-mean", "template": "Q: {prompt}\nA:", "prompt_key": "123",
     "log_with": "none", "is_level": "geometric", "dtype": "bfloat16", "task": "math_jsonl", "data_path": "yes"},
    {"band": "0.6,1.4", "clip_eps_high": 0.28, "kl_coef": 0.0},
])
def test_save_load_round_trip(tmp_path, overrides):
    config = load_config(overrides=overrides)
    path = tmp_path / "saved.yaml"
    save_config(config, path)
    again = load_config(path)
    assert again == config
    assert dataclasses.asdict(again) == dataclasses.asdict(config)
