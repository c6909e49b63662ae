"""The TRL / verl adapters: the documented example runs, and each library's keys reach the right inputs."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import pytest
import torch

from sparserl.interop import corrections_from_trl, corrections_from_verl

DOC = Path(__file__).parents[1] / "docs" / "interop.md"


def test_the_documented_example_runs_and_prints_what_the_doc_says():
    text = DOC.read_text().split("## Our corrections on a TRL or verl batch", 1)[1]  # its runnable example
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(DOC), "exec"), {})
    shown = re.search(r"Output[^\n]*\n\n```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert printed.getvalue().splitlines()[:len(shown)] == shown


def test_keys_map_to_old_sampler_and_mask():
    # Row 0: the sampler found token 1 e^10 times likelier than the trainer (ξ = e^-10 < 1e-4);
    # row 1: no mismatch; the mask hides row 1's last token, whose garbage must not count.
    old = torch.tensor([[-1.0, -11.0, -1.0], [-1.0, -1.0, float("nan")]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    trl = corrections_from_trl({"old_per_token_logps": old, "sampling_per_token_logps": sampler,
                                "completion_mask": mask}, "prefix-veto-tis")
    verl = corrections_from_verl({"old_log_probs": old, "rollout_log_probs": sampler, "response_mask": mask},
                                 "prefix-veto-tis")
    expected = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert trl.keep_mask.tolist() == expected and verl.keep_mask.tolist() == expected
    assert math.isclose(trl.metrics["xi_min"], math.exp(-10), rel_tol=1e-6)
    # TRL without π_old: the current log-probs, detached, stand in for it.
    swapped = corrections_from_trl({"old_per_token_logps": None, "sampling_per_token_logps": sampler,
                                    "completion_mask": mask}, "sparse-rl", old=sampler.clone())
    assert swapped.keep_mask.tolist() == mask.tolist()
    with pytest.raises(KeyError, match="old_per_token_logps"):
        corrections_from_trl({"sampling_per_token_logps": sampler, "completion_mask": mask})


# verl 0.9's settings for each preset, worked out by hand from verl's rollout_corr_helper.py: k1 bounds are on
# π_rollout / π_old (the inverse of ξ), so a band [a, b] is "1/b_1/a"; the 1e-4 veto is seq_max_k2 at
# (ln 10^4)^2 / 2 = 9.210340371976184^2 / 2 = 42.41518...
VETO_K2 = math.log(10 ** 4) ** 2 / 2
VERL = {
    "dense": ("exact", {"rollout_is": None, "rollout_rs": None}),
    "naive-sparse": ("exact", {"rollout_is": None, "rollout_rs": None}),
    "sparse-tis": ("exact", {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True,
                             "rollout_rs": None}),
    "sparse-rl": ("approximate", {"rollout_is": "token", "rollout_is_threshold": 1.5,
                                  "rollout_is_batch_normalize": True, "rollout_rs": "token_k1,seq_max_k2",
                                  "rollout_rs_threshold": f"{2 / 3!r}_2.0,{VETO_K2!r}"}),
    "sparse-rs": ("approximate", {"rollout_is": None, "rollout_rs": "token_k1,seq_max_k2",
                                  "rollout_rs_threshold": f"{2 / 3!r}_2.0,{VETO_K2!r}"}),
    "geo-rs": ("approximate", {"rollout_is": None, "rollout_rs": "seq_mean_k1,seq_max_k2",
                               "rollout_rs_threshold": f"{1 / 1.105!r}_{1 / 0.905!r},{VETO_K2!r}"}),
    "k3-rs": ("exact", {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1}),
    "seq-mask-tis": ("exact", {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                               "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": f"{1 / 1.105!r}_{1 / 0.905!r}"}),
    "prefix-veto-tis": ("partial", {"rollout_is": "token", "rollout_is_threshold": 1.5,
                                    "rollout_is_batch_normalize": True, "rollout_rs": None}),
}


@pytest.mark.parametrize("preset", sorted(VERL))
def test_each_preset_maps_to_verls_settings_as_worked_out_by_hand(preset):
    from sparserl.interop import verl_rollout_correction

    match, settings = VERL[preset]
    mapped = verl_rollout_correction(preset)
    assert mapped.match == match and mapped.settings == {"bypass_mode": False, **settings}
    assert bool(mapped.notes) == (match != "exact" or settings.get("rollout_is_batch_normalize", False))


def test_every_correction_setting_has_a_mapping_or_says_it_has_none():
    from sparserl.config.corrections import CorrectionConfig
    from sparserl.interop import verl_rollout_correction

    assert verl_rollout_correction(CorrectionConfig(is_level="geometric")).match == "partial"
    clip = verl_rollout_correction(CorrectionConfig(veto_threshold=None, band=None, is_mode="clip", is_cap=2.0))
    assert clip.match == "partial" and clip.settings["rollout_is"] is None
    mask = verl_rollout_correction(CorrectionConfig(veto_threshold=None, band=None, is_mode="mask", is_cap=2.0,
                                                    batch_normalize=False))
    assert mask.match == "exact" and mask.settings["rollout_is_threshold"] == "1e-09_2.0"
    guard = verl_rollout_correction(CorrectionConfig(veto_threshold=None, band=None, is_mode="none",
                                                     batch_normalize=False, seq_log_ratio_max=3.0))
    assert guard.match == "exact" and guard.settings["rollout_rs_threshold"] == 4.5  # 3^2 / 2


def test_verls_own_helper_gives_our_masks_and_weights():
    """Against verl's `rollout_corr_helper` where verl installs (it needs transformers < 5.11, so not in this
    project's environment: docs/interop.md has the separate environment this runs in). Every preset verl can
    express, on a batch without a token of ξ > 10^4 (where the approximate ones differ)."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    from sparserl.interop import corrections_from_verl, verl_rollout_correction

    torch.manual_seed(0)
    old = -torch.rand(64, 40, dtype=torch.float64) * 3
    rollout = old + 0.15 * torch.randn(64, 40, dtype=torch.float64)
    rollout[5, 7] = old[5, 7] + 11.0  # ξ = e^-11: vetoed by ours and by verl's seq_max_k2 guard
    mask = torch.ones(64, 40, dtype=torch.float64)
    mask[3, 30:] = 0
    for preset in (p for p in VERL if VERL[p][0] != "partial"):
        settings = {k: v for k, v in verl_rollout_correction(preset).settings.items() if k != "bypass_mode"}
        ours = corrections_from_verl({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}, preset)
        weights, keep, _ = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
        assert torch.equal(keep.bool(), ours.keep_mask.bool()), preset
        if weights is not None:
            theirs = weights.batch["rollout_is_weights"]
            torch.testing.assert_close(theirs * keep, ours.weights * ours.keep_mask, rtol=1e-7, atol=0)
