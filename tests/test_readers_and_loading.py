"""Reading what runs leave behind and loading models: each way a file can be bad is reproduced on
files made here (a tiny model saved by the test, no downloads) and must be named with what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from sparserl.model.loading import ModelFilesError, load_policy
from sparserl.train.metrics import read_metrics


# ---------------------------------------------------------------------------- metrics.jsonl
def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a": ')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: line 3 was cut off by an interrupted write"):
        assert read_metrics(path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]


@pytest.mark.parametrize("bad_line, problem", [
    ('{"step": 1, "a": ', "line 2 is not valid JSON"),  # torn, but not the last line: not a crash mid-write
    ("[1, 2]", "line 2 is not a step record"),
    ('{"reward_mean": 0.5}', "line 2 is not a step record"),
    ('{"step": "1"}', "line 2 is not a step record"),
])
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 0}}\n{bad_line}\n{{"step": 2}}\n')
    with pytest.raises(ValueError, match=rf"metrics.jsonl: {problem}.*remove or repair that line"):
        read_metrics(path)


def test_a_last_line_that_parses_but_is_no_step_record_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n"hello"\n')
    with pytest.raises(ValueError, match=r"line 2 is not a step record"):
        read_metrics(path)



# ---------------------------------------------------------------------------- a math JSONL file
# (A raw form feed is no test: JSON refuses control characters below U+0020 inside a string.)
@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_a_jsonl_record_with_a_raw_line_separator_in_a_string_is_one_record(tmp_path, separator):
    """JSON allows these characters unescaped inside a string; JSON Lines breaks records at "\\n" (and "\\r\\n")
    only. `str.splitlines()` breaks at all of them and cut such a record in two."""
    from sparserl.tasks.math_jsonl import MathJsonlTask

    prompt = f"first part{separator}second part"
    # Written by hand, not by json.dumps (which would escape the separator): the raw character sits in the file.
    text = ('{"prompt": "What is 1 + 1?", "label": "2"}\r\n'
            f'{{"prompt": "{prompt}", "label": "7"}}\r\n'
            '\n'
            '{"prompt": "What is 2 + 2?", "label": 4}\n')
    assert separator in text and "\\u" not in text
    path = tmp_path / "data.jsonl"
    path.write_bytes(text.encode("utf-8"))
    task = MathJsonlTask(path, test_fraction=0.34)
    records = task.examples(2, seed=0, split="train") + task.examples(1, seed=0, split="test")
    by_line = {e.extra["line"]: (e.prompt, e.label) for e in records}
    assert by_line == {1: ("What is 1 + 1?", "2"), 2: (prompt, "7"), 4: ("What is 2 + 2?", "4")}


def test_a_bad_jsonl_record_is_named_by_its_newline_counted_line(tmp_path):
    from sparserl.errors import DataError
    from sparserl.tasks.math_jsonl import MathJsonlTask

    path = tmp_path / "data.jsonl"
    path.write_bytes('{"prompt": "a\u2028b", "label": "1"}\n{"prompt": "c", "label": "2"}\n{"prompt": \n'.encode())
    with pytest.raises(DataError, match=r"data.jsonl line 3: invalid JSON"):
        MathJsonlTask(path)


# ---------------------------------------------------------------------------- model directories
@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny saved model, for a test to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _load_error(directory: Path, **kwargs) -> str:
    with pytest.raises(ModelFilesError) as caught:
        load_policy(str(directory), **kwargs)
    message = str(caught.value)
    assert "\n" not in message and str(directory) in message, message
    return message


def _shard(directory: Path) -> list[Path]:
    """Save the same weights in several safetensors shards instead of one file; the shards, in order."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    (directory / "model.safetensors").unlink()
    model.save_pretrained(directory, max_shard_size="20KB")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 2
    return shards


def test_the_tiny_model_loads(model_copy):
    model, tokenizer = load_policy(str(model_copy))
    assert model.config.model_type == "llama" and tokenizer.padding_side == "left"


def test_a_truncated_safetensors_file_is_named_as_damaged(model_copy):
    _cut_in_half(model_copy / "model.safetensors")
    message = _load_error(model_copy)
    assert message.startswith(f"model.safetensors in {model_copy} is damaged (")
    assert "file not fully covered" in message and "save_pretrained" in message


def test_a_damaged_shard_is_named_and_the_whole_ones_are_not(model_copy):
    shards = _shard(model_copy)
    shards[1].write_bytes(b"\x00" * 64)  # a header length of 0: not a safetensors file at all
    message = _load_error(model_copy)
    assert message.startswith(f"{shards[1].name} in {model_copy} is damaged (")
    assert all(shard.name not in message for shard in shards[:1] + shards[2:])


def test_a_missing_shard_is_named(model_copy):
    shards = _shard(model_copy)
    shards[-1].unlink()
    message = _load_error(model_copy)
    assert "is missing" in message and shards[-1].name in message and "copy the whole model directory" in message


@pytest.mark.parametrize("kept, reader_says", [(0.5, "PytorchStreamReader failed"), (5000, "[Errno 22]")])
def test_a_truncated_pytorch_bin_is_named_as_damaged(model_copy, kept, reader_says):
    """Cut in half, torch's reader raises a RuntimeError; cut to its first 5,000 bytes, a bare OSError."""
    weights = load_file(model_copy / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    path = model_copy / "pytorch_model.bin"
    torch.save(weights, path)
    load_policy(str(model_copy))  # whole, it loads
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * kept) if kept < 1 else kept])
    message = _load_error(model_copy)
    assert message.startswith(f"pytorch_model.bin in {model_copy} is damaged ({reader_says}")


@pytest.mark.parametrize("changes, needles", [
    ({"model_type": "nonexistent_arch"},
     ["config.json: the installed transformers", "does not know the architecture 'nonexistent_arch'"]),
    # A model shipping its own code: refused here instead of transformers asking on stdin whether to run it.
    ({"model_type": "custom_arch", "auto_map": {"AutoModelForCausalLM": "modeling.CustomForCausalLM"}},
     ["does not know the architecture 'custom_arch'"]),
    ({"model_type": "nonexistent_arch", "transformers_version": "99.0.0"},
     ["written by transformers 99.0.0", "does not know its model_type 'nonexistent_arch'",
      "install transformers 99.0.0 or later"]),
    ({"model_type": "t5"}, ["model_type 't5' is not a causal language model"]),
    ({"model_type": None}, ["has no model_type"]),
])
def test_an_architecture_transformers_cannot_load_is_named(model_copy, changes, needles):
    _edit_config(model_copy, **changes)
    message = _load_error(model_copy)
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("text, needle", [("{oops", "config.json is not valid JSON (Expecting property name"),
                                          ("[1, 2]", "config.json holds a JSON list")])
def test_a_config_that_is_not_a_json_object_is_named(model_copy, text, needle):
    (model_copy / "config.json").write_text(text)
    assert needle in _load_error(model_copy)


def test_a_config_value_this_transformers_rejects_is_named(model_copy):
    _edit_config(model_copy, hidden_size="wide")
    message = _load_error(model_copy)
    assert f"config.json has a value the installed transformers {transformers.__version__} rejects" in message
    assert "Field 'hidden_size' expected int, got str" in message


def test_a_config_from_a_newer_transformers_says_so(model_copy):
    # A rope type this transformers lacks, in a config written by a later release.
    _edit_config(model_copy, rope_parameters={"rope_type": "nonexistent_rope"}, transformers_version="99.0.0")
    message = _load_error(model_copy)
    assert "(KeyError: 'nonexistent_rope')" in message
    assert f"written by transformers 99.0.0, newer than the installed {transformers.__version__}" in message


def test_an_unrecognised_failure_keeps_its_type_and_message(model_copy):
    # The same rope type in a config of this very transformers: nothing known explains it.
    _edit_config(model_copy, rope_parameters={"rope_type": "nonexistent_rope"})
    with pytest.raises(KeyError) as caught:
        load_policy(str(model_copy))
    assert not isinstance(caught.value, ModelFilesError) and caught.value.args == ("nonexistent_rope",)
    assert caught.value.__notes__ == [f"(while loading the model in {model_copy})"]


def test_weights_that_do_not_fit_the_config_are_named(model_copy):
    _edit_config(model_copy, hidden_size=2 * json.loads((model_copy / "config.json").read_text())["hidden_size"])
    assert "do not fit its config.json (tensor shapes differ" in _load_error(model_copy)


def test_running_out_of_memory_while_loading_is_named(model_copy, monkeypatch):
    # A genuine allocator failure (4 PiB) where the model moves to its device.
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *args, **kwargs: torch.empty(1 << 50))
    message = _load_error(model_copy)
    assert f"out of memory loading the model in {model_copy} onto cpu (" in message
    assert "can't allocate memory" in message and "--dtype bfloat16" in message
    assert "--dtype" not in _load_error(model_copy, dtype=torch.bfloat16)  # nothing smaller to suggest


def test_a_damaged_tokenizer_file_is_named(model_copy):
    (model_copy / "tokenizer.json").write_text('{"version": ')
    assert _load_error(model_copy).startswith(f"tokenizer.json in {model_copy} is not valid JSON")


def test_a_tokenizer_without_tokenizer_json_is_named(model_copy):
    (model_copy / "tokenizer.json").unlink()  # tokenizer_config.json alone cannot rebuild it
    assert "has no tokenizer.json" in _load_error(model_copy)


@pytest.mark.parametrize("remove, needle", [(["config.json"], "lacks config.json"),
                                            (["model.safetensors"], "lacks model weights (*.safetensors or *.bin)"),
                                            (["tokenizer.json", "tokenizer_config.json"], "lacks tokenizer files")])
def test_a_missing_file_is_named(model_copy, remove, needle):
    for name in remove:
        (model_copy / name).unlink()
    assert needle in _load_error(model_copy)


def test_a_loaded_model_computes_the_bits_of_a_fresh_copy_of_its_weights():
    """safetensors hands out tensors at their offsets in the file; a CPU's matmul kernels round misaligned
    operands differently, so the shipped model, loaded, once sampled 1e-6 apart from a Ray worker's copy of
    the same weights in fresh memory. Loading moves every tensor into aligned memory of its own."""
    from transformers import AutoModelForCausalLM

    from sparserl.model.loading import ALIGNMENT_BYTES, load_policy

    model, _ = load_policy(None)
    assert all(t.data_ptr() % ALIGNMENT_BYTES == 0 for t in (*model.parameters(), *model.buffers()))
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    copy.load_state_dict(model.state_dict())
    ids = torch.randint(1, model.config.vocab_size, (64, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, copy(input_ids=ids).logits)
