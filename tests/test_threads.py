"""--threads auto: one thread for a small model, the free cores for a large one, the recorded count on resume."""

from __future__ import annotations

import json

import pytest
import torch

from sparserl.cli import main
from sparserl.model import threads as threads_module
from sparserl.model.threads import SMALL_MODEL_PARAMETERS, choose_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _machine(monkeypatch, cores: int, load: float) -> None:
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(threads_module.os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize("cores, load, expected", [(8, 0.0, 8), (8, 2.6, 5), (2, 1.2, 1), (2, 5.0, 1), (4, 0.4, 4)])
def test_auto_gives_a_large_model_the_cores_others_leave_free(monkeypatch, cores, load, expected):
    _machine(monkeypatch, cores, load)
    assert choose_threads("auto", SMALL_MODEL_PARAMETERS).threads == expected


def test_auto_gives_a_small_model_one_thread_however_many_cores_are_free(monkeypatch):
    _machine(monkeypatch, 16, 0.0)
    assert choose_threads("auto", SMALL_MODEL_PARAMETERS - 1).threads == 1


def test_auto_keeps_a_recorded_count_and_explicit_settings_win(monkeypatch, restore_threads):
    _machine(monkeypatch, 16, 0.0)
    assert choose_threads("auto", 10, recorded=3).threads == 3
    assert choose_threads(5, 10, recorded=3).threads == 5
    torch.set_num_threads(2)
    assert choose_threads(0, 10**9).threads == 2  # 0: leave torch's count as it is


def test_a_resumed_auto_run_keeps_the_thread_count_it_started_with(tiny_model_dir, tmp_path, restore_threads):
    args = ["train", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), "--prompts-per-step", "2",
            "--group-size", "2", "--difficulty", "3", "--eval-every", "0", "--checkpoint-every", "1",
            "--log-with", "none"]
    assert main([*args, "--steps", "1", "--threads", "2"]) == 0
    torch.set_num_threads(1)
    assert main([*args, "--steps", "2", "--threads", "auto", "--resume"]) == 0
    assert torch.get_num_threads() == 2  # not auto's 1 for a tiny model: the run's sums stay as they were
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["threads"] == 2


def test_a_fresh_auto_run_records_one_thread_for_the_tiny_model(tiny_model_dir, tmp_path, restore_threads):
    torch.set_num_threads(2)
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), "--steps", "1",
                 "--prompts-per-step", "2", "--group-size", "2", "--difficulty", "3", "--eval-every", "0",
                 "--log-with", "none"]) == 0
    assert torch.get_num_threads() == 1
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["threads"] == 1
