"""Presets: each mode's rollouts and corrections as the literature defines them, and the listing."""

from __future__ import annotations

import pytest

from sparserl.cli import main
from sparserl.config.presets import PRESETS, RECOMMENDED
from sparserl.config.schema import load_config
from sparserl.errors import ConfigError

OFF = dict(veto_threshold=None, veto_scope="sequence", band=None, seq_geo_bounds=None, seq_k3_max=None,
           seq_log_ratio_max=None, is_mode="none", is_cap=1.5, is_level="token", batch_normalize=False)
TIS = dict(is_mode="truncate", is_cap=1.5, batch_normalize=True)
EXPECTED = {  # mode: (sparse rollouts, fields that differ from "off")
    "dense": (False, {}),
    "naive-sparse": (True, {}),
    "sparse-rl": (True, dict(veto_threshold=1e-4, band=(0.5, 1.5), **TIS)),  # the paper, unchanged
    "sparse-tis": (True, TIS),
    "sparse-rs": (True, dict(veto_threshold=1e-4, band=(0.5, 1.5))),
    "geo-rs": (True, dict(veto_threshold=1e-4, seq_geo_bounds=(0.905, 1.105))),
    "k3-rs": (True, dict(seq_k3_max=0.1)),
    "seq-mask-tis": (True, dict(seq_geo_bounds=(0.905, 1.105), is_mode="truncate", is_cap=2.0)),
    "prefix-veto-tis": (True, dict(veto_threshold=1e-4, veto_scope="prefix", **TIS)),
    "sparse-learner": (True, {}),  # the learner through the sampler's attention: nothing to correct
    "nemo-fp8": (True, dict(is_mode="truncate", is_cap=2.0)),  # NeMo-RL: token TIS at C = 2, not normalised
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_preset_is_what_it_says(mode):
    sparse, fields = EXPECTED[mode]
    config = load_config(overrides={"mode": mode})
    assert PRESETS[mode].sparse_rollouts is sparse
    assert {k: getattr(config.correction, k) for k in OFF} == {**OFF, **fields}


def test_sparrow_uses_the_recommended_correction_and_a_schedule(tmp_path):
    assert PRESETS["sparrow"].correction == PRESETS[RECOMMENDED].correction and PRESETS["sparrow"].needs_schedule
    assert load_config(overrides={"mode": "sparrow"}).rollout.kv_schedule == "adaptive"  # no file: adapt online
    (tmp_path / "s.yaml").write_text("bin_size: 16\nbudgets: [40, 80]\n")
    assert load_config(overrides={"mode": "sparrow", "kv_schedule": str(tmp_path / "s.yaml")}).rollout.kv_schedule \
        == str(tmp_path / "s.yaml")


def test_a_flag_overrides_the_preset():
    config = load_config(overrides={"mode": "sparse-rl", "veto_threshold": "1e-6", "veto_scope": "prefix"})
    assert (config.correction.veto_threshold, config.correction.veto_scope, config.correction.band) == \
        (1e-6, "prefix", (0.5, 1.5))


def test_presets_command_lists_every_mode(capsys):
    assert main(["presets"]) == 0
    printed = capsys.readouterr().out
    for mode in PRESETS:
        assert f"| `{mode}` |" in printed
    assert "prefix veto ξ < 0.0001" in printed


def test_the_preset_site_carries_what_reports_and_plots_need():
    from sparserl.config.presets import DEFAULT_COMPARE, mode_with_role

    colours = [p.colour for p in PRESETS.values()]
    assert all(colours) and len(set(colours)) == len(colours), "each built-in mode is one distinct colour in plots"
    for role in ("baseline", "uncorrected", "published", "recommended"):
        assert [name for name, p in PRESETS.items() if p.role == role] == [mode_with_role(role)]
    assert not PRESETS[mode_with_role("baseline")].sparse_rollouts
    assert all(PRESETS[mode_with_role(r)].sparse_rollouts for r in ("uncorrected", "published", "recommended"))
    assert DEFAULT_COMPARE[0] == mode_with_role("baseline") and mode_with_role("published") in DEFAULT_COMPARE


def test_nemo_fp8_samples_through_a_full_fp8_cache_unless_the_run_says_otherwise(tmp_path):
    config = load_config(overrides={"mode": "nemo-fp8"})
    assert (config.rollout.sparsity, config.rollout.kv_dtype) == ("none", "fp8")
    config = load_config(overrides={"mode": "nemo-fp8", "kv_dtype": "int8"})  # the flag wins over the preset
    assert (config.rollout.sparsity, config.rollout.kv_dtype) == ("none", "int8")
    (tmp_path / "run.yaml").write_text("rollout:\n  sparsity: eviction\n")  # so does the config file
    config = load_config(tmp_path / "run.yaml", {"mode": "nemo-fp8"})
    assert (config.rollout.sparsity, config.rollout.kv_dtype) == ("eviction", "fp8")
    assert load_config(overrides={"mode": "geo-rs"}).rollout.kv_dtype == "auto"  # other presets leave it alone


def test_a_preset_file_sets_its_samplers_kind_and_is_refused_anything_else(tmp_path):
    good = tmp_path / "int8-tis.yaml"
    good.write_text("base: nemo-fp8\nrollout: {kv_dtype: int8}\nsource: my notes\n")
    config = load_config(overrides={"mode": str(good)})
    assert (config.rollout.sparsity, config.rollout.kv_dtype, config.correction.is_cap) == ("none", "int8", 2.0)
    budget = tmp_path / "budget.yaml"
    budget.write_text("base: geo-rs\nrollout: {kv_budget: 40}\n")
    with pytest.raises(ConfigError, match="rollout sets only sparsity, kv_dtype"):
        load_config(overrides={"mode": str(budget)})
    dense = tmp_path / "dense-fp8.yaml"
    dense.write_text("sparse_rollouts: false\nrollout: {kv_dtype: fp8}\n")
    with pytest.raises(ConfigError, match="samples densely: set sparse_rollouts: true"):
        load_config(overrides={"mode": str(dense)})


def test_every_builtin_preset_names_its_source(capsys):
    assert all(preset.source for preset in PRESETS.values())
    assert main(["presets"]) == 0
    assert "NeMo-RL pull request 1212" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    ({"mode": "nemo-fp8", "kv_schedule": "adaptive"}, "--sparsity none keeps every token"),
    ({"mode": "sparrow", "sparsity": "none"}, "--sparsity none keeps every token"),
])
def test_a_full_cache_is_refused_a_budget_schedule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
