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
    text = DOC.read_text()
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
