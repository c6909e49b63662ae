"""The `sparserl` command line: help listing, error exits, and `eval` on a tiny model; pass@k."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
import typing
import warnings
from fractions import Fraction

import pytest

from sparserl.cli import main
from sparserl.config import schema as config_module
from sparserl.config.presets import PRESETS
from sparserl.train.evaluation import pass_at_k

MODES = tuple(PRESETS)
CORRECTION_FIELDS = {f.name for f in dataclasses.fields(config_module.CorrectionConfig)}


@pytest.fixture(autouse=True)
def _keep_global_state(monkeypatch):
    # main() installs its own warning formatter; put it back after each test.
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help to the terminal width


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _entries(help_text: str) -> dict[str, str]:
    """flag -> its help entry (the flag's line plus continuation lines), from argparse output."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (-{1,2}[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _all_fields() -> list[tuple[str, object]]:
    """(name, default) of every leaf field of every config section."""
    out = []
    for section in dataclasses.fields(config_module.ExperimentConfig):
        cls = typing.get_type_hints(config_module.ExperimentConfig)[section.name]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f.name, default))
    return out


# ----------------------------------------------------------------------------- help
def test_train_help_lists_every_config_field_with_its_default(capsys):
    entries = _entries(_help(capsys, "train"))
    fields = _all_fields()
    assert len(fields) > 40
    for name, default in fields:
        flag = "--" + name.replace("_", "-")
        assert flag in entries, f"{flag} missing from train --help"
        shown = "none" if default is None else ",".join(map(str, default)) if isinstance(default, tuple) else default
        if name in CORRECTION_FIELDS:  # the mode's preset sets them
            shown = "set by --mode"
        if default == "":  # an empty default is said in the field's own words, once
            assert entries[flag].count("(default:") == 1, entries[flag]
        else:
            assert f"(default: {shown})" in entries[flag], entries[flag]
        # A one-line description before the default, not just the default.
        description = entries[flag].split(None, 2)[2].split("(default:")[0].strip()
        assert len(description) > 8, entries[flag]
    assert "INT" in entries["--kv-budget"] and "(default: 80)" in entries["--kv-budget"]
    assert "(default: set by --mode)" in entries["--veto-threshold"] and "FLOAT|none" in entries["--veto-threshold"]
    assert "{seq-mean-token-mean,token-mean}" in entries["--loss-agg"]
    assert "(default: seq-mean-token-mean)" in entries["--loss-agg"]
    assert "{" + ",".join(MODES) + "}|FILE.yaml" in entries["--mode"]
    assert "(default: dense)" in entries["--mode"]
    assert "(default: set by --mode)" in entries["--band"] and "LOW,HIGH|none" in entries["--band"]
    assert "{h2o,pyramidkv,rkv,snapkv,streamingllm}" in entries["--kv-policy"]
    assert entries["--reward-weights"].endswith("one per reward function (default: all 1)")


@pytest.mark.parametrize("command, flags", [
    ("train", ("--out", "--steps", "--mode", "--seed", "--config", "--resume")),
    ("eval", ("--out", "--model", "--n", "--kv-policy", "--kv-budget", "--kv-interval", "--samples")),
    ("warmup", ("--out",)),
])
def test_subcommand_flags(capsys, command, flags):
    entries = _entries(_help(capsys, command))
    for flag in flags:
        assert flag in entries, f"{flag} missing from {command} --help"


def test_eval_has_one_out_flag(capsys):
    text = _help(capsys, "eval")
    assert len(re.findall(r"^  --out\b", text, flags=re.M)) == 1


# Flags no inference command reads: training's, Ray's, the speculative sampler's, the adaptive schedule's.
NOT_READ_BY_INFERENCE = ("--lr", "--mode", "--steps", "--veto-threshold", "--checkpoint-every", "--group-size",
                         "--prompts-per-step", "--ignore-eos", "--rollout-workers", "--rollout-backend",
                         "--rollout-shards", "--ray-address", "--rollout-timeout", "--worker-gpus", "--worker-cpus",
                         "--speculative", "--speculative-draft", "--draft-tokens", "--alpha-every",
                         "--recalibrate-every")


@pytest.mark.parametrize(("command", "takes", "refuses"), [
    ("eval", ("--kv-budget", "--kv-schedule", "--temperature", "--alpha-bin-size"), ("--alpha-tau",)),
    ("sweep", ("--budgets", "--temperature"), ("--kv-budget", "--kv-schedule", "--alpha-bin-size", "--alpha-tau")),
    ("audit", ("--kv-budget", "--kv-schedule"), ("--temperature", "--alpha-bin-size", "--alpha-tau")),
    ("calibrate", ("--alpha-tau", "--calibration-budgets", "--alpha-bin-size", "--calibration-prompts",
                   "--calibration-samples", "--temperature"),
     ("--kv-budget", "--kv-schedule", "--tau", "--budgets", "--bin-size", "--prompts", "--samples")),
])
def test_inference_commands_list_only_what_they_read(capsys, command, takes, refuses):
    entries = _entries(_help(capsys, command))
    for flag in ("--model", "--difficulty", "--seed", "--kv-policy", "--kv-window", "--rollout-kv-memory",
                 "--max-concurrent-rows", *takes):
        assert flag in entries, flag
    for flag in NOT_READ_BY_INFERENCE + refuses:
        assert flag not in entries, f"{command} --help lists {flag}, which it does not read"


def test_a_flag_an_inference_command_does_not_read_is_refused(capsys, tmp_path):
    """`eval --rollout-workers 2` once ran in this process without Ray installed, the flag read by nothing."""
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--out", str(tmp_path / "e.json"), "--rollout-workers", "2"])
    assert exit_.value.code == 2 and "unrecognized arguments: --rollout-workers" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "audit"])
def test_an_adaptive_schedule_is_refused_by_inference(capsys, tmp_path, command):
    assert main([command, "--out", str(tmp_path / "r.json"), "--kv-schedule", "adaptive"]) == 2
    assert "adapts during training only" in capsys.readouterr().err


def test_top_level_help_imports_neither_torch_nor_transformers():
    """`sparserl --help` must answer at once: it builds no command's options and imports no framework."""
    code = ("import sys, contextlib, io\nfrom sparserl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['--help'])\n    except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("argv, key", [
    (["train", "--kv-budget", "abc"], "kv_budget"),
    (["train", "--mode", "bogus"], "mode"),
    (["train", "--steps", "1.5"], "steps"),
    (["train", "--band", "0.5"], "band"),
    (["train", "--kv-budget", "4", "--kv-window", "8"], "kv_budget"),
    (["eval", "--out", "x.json", "--kv-per-head", "maybe"], "kv_per_head"),
])
def test_bad_flag_value_exits_2_with_one_line(capsys, tmp_path, argv, key):
    code = main(argv + (["--out", str(tmp_path / "run")] if argv[0] == "train" else []))
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("sparserl: error:") and key in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--kv-budgett", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err  # with the command's usage line, not the top level's
    assert err.startswith("usage: sparserl train") and "unrecognized arguments: --kv-budgett 3" in err


@pytest.mark.parametrize("argv, told", [
    (["calibrate", "--tau", "0.86", "--prompts", "32"],  # --out missing too: the rename is said first
     "--tau is now --alpha-tau; --prompts is now --calibration-prompts (renamed)"),
    (["calibrate", "--out", "c", "--budgets=32,64", "--bin-size", "8", "--samples", "2"],
     "--budgets is now --calibration-budgets; --bin-size is now --alpha-bin-size; "
     "--samples is now --calibration-samples"),
])
def test_a_renamed_flag_says_its_new_name(capsys, argv, told):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and told in err and "unrecognized arguments" not in err


def test_every_renamed_flag_names_a_flag_its_command_has_and_is_no_longer_one():
    from sparserl.cli import _build_parser
    from sparserl.commands import COMMANDS

    for name, registered in COMMANDS.items():
        flags = set(_build_parser(name)[1]._option_string_actions)
        for old, new in registered.renamed.items():
            assert new in flags and old not in flags, (name, old, new)


def test_speculative_help_says_what_it_buys_and_what_it_costs_as_measured(capsys):
    """The figures are docs/benchmarks.md's: the H200 table's spec rows and the CPU table's CPU-time ratios."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    start = help_text.index("--speculative [BOOL] lossless")  # its help, past the usage line
    speculative = help_text[start:help_text.index("--speculative-draft", start)]
    for needle in ("exact dense samples", "0.16-0.27x dense's tokens/s", "H200", "0.69-1.12x", "CPU"):
        assert needle in speculative, needle


def test_eval_missing_model_says_what_to_do(capsys, tmp_path):
    code = main(["eval", "--out", str(tmp_path / "e.json"), "--model", "/nonexistent", "--n", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "/nonexistent" in err
    assert "--model" in err and "save_pretrained" in err  # the remedy
    assert not (tmp_path / "e.json").exists()


@pytest.mark.parametrize("argv, read", [
    (["train", "--kv-per-head", "--steps", "1"], lambda args: args.cfg__kv_per_head == "true"),
    (["train", "--overwrite"], lambda args: args.overwrite is True),
    (["train", "--overwrite", "false"], lambda args: args.overwrite is False),
    (["sft", "--out", "m", "--overwrite", "--chat-template", "false"],
     lambda args: (args.sft__overwrite, args.cfg__chat_template) == ("true", "false")),
    (["warmup", "--out", "m", "--overwrite"], lambda args: args.dc__overwrite == "true"),
])
def test_a_yes_no_setting_given_alone_means_yes(argv, read):
    from sparserl.cli import _build_parser

    assert read(_build_parser(argv[0])[0].parse_args(argv))


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and re.fullmatch(r"sparserl \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_an_abbreviated_flag_is_not_taken_for_another(capsys, tmp_path):
    """argparse would read `eval --mode` as `--model` (an unambiguous prefix); here it is an unknown flag."""
    with pytest.raises(SystemExit) as info:
        main(["eval", "--out", str(tmp_path / "e.json"), "--mode", "sparse-rl"])
    assert info.value.code == 2 and "unrecognized arguments: --mode" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--out", "{tmp}", "--n", "1"], "--out {tmp} is a directory; give a file name such as"),
    (["eval", "--out", "{tmp}/e.json", "--answers", "{tmp}", "--n", "1"], "--answers {tmp} is a directory"),
    (["sweep", "--out", "{tmp}", "--n", "1"], "--out {tmp} is a directory"),
    (["audit", "--out", "{tmp}/blocker/a.json", "--n", "1"], "blocker is a file; choose a writable path"),
    (["calibrate", "--out", "{tmp}/blocker"], "--out {tmp}/blocker is a file; give a directory"),
    (["sweep", "--out", "{tmp}/s.json", "--budgets", "4,40"], "--budgets: 4 do(es) not exceed kv_window (8)"),
    (["eval", "--out", "{tmp}/e.json", "--inference", "dense", "--kv-budget", "12", "--n", "1"],
     "--inference dense decodes with the whole cache, so --kv-budget would do nothing"),
    (["eval", "--out", "{tmp}/e.json", "--inference", "dense", "--alpha", "true", "--alpha-bin-size", "8"],
     "--inference dense measures no α (α compares a sparse sampler with the dense model), so --alpha, "
     "--alpha-bin-size would do nothing; drop it, or ask --inference sparse or both"),
    (["eval", "--out", "{tmp}/e.json", "--alpha", "false"],
     "dense inference (the default without --kv-* flags) measures no α"),
    (["train", "--out", "{tmp}/r", "--mode", "geo-rs", "--is-cap", "3"],
     "--is-cap would do nothing: mode geo-rs weights every token by 1 (is_mode none)"),
    (["compare", "--out", "{tmp}/c", "--modes", "dense,sparse-rs", "--is-level", "sequence", "--batch-normalize"],
     "--is-level, --batch-normalize would do nothing: modes dense, sparse-rs weight every token by 1"),
])
def test_an_output_or_option_that_cannot_work_is_refused_before_any_work(capsys, tmp_path, monkeypatch, argv,
                                                                          needle):
    """Refused before the model is even loaded (loading it would fail: --model names nothing)."""
    (tmp_path / "blocker").write_text("x")
    argv = [part.format(tmp=tmp_path) for part in argv] + ["--model", str(tmp_path / "no-model")]
    assert main(argv) == 2
    assert needle.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["train", "--mode", "geo-rs", "--is-cap", "3", "--is-mode", "truncate"],  # the flag now weights
    ["compare", "--modes", "dense,geo-rs,sparse-rl", "--is-cap", "3"],  # sparse-rl weights by ξ
    ["train", "--config", "{tmp}/saved.yaml"],  # a saved config names every field, the idle ones too
])
def test_a_weight_setting_that_some_mode_uses_is_not_refused(capsys, tmp_path, argv):
    (tmp_path / "saved.yaml").write_text("train: {mode: geo-rs}\ncorrection: {is_mode: none, is_cap: 1.5}\n")
    argv = [part.format(tmp=tmp_path) for part in argv] + ["--out", str(tmp_path / "r"), "--model",
                                                           str(tmp_path / "no-model")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "would do nothing" not in err and "no-model" in err  # it went on, as far as loading the model


def test_eval_says_which_inference_it_chose_for_a_sparse_config(tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "sparse.yaml"
    config.write_text("rollout: {kv_policy: snapkv, kv_budget: 12}\ntrain: {mode: sparse-rl}\n")
    out = tmp_path / "e.json"
    assert main(["eval", "--config", str(config), "--out", str(out), "--model", str(tiny_model_dir), *EVAL_ARGS,
                 "--samples", "0"]) == 0
    assert "eval: dense inference (the default); --inference sparse or both decodes with the config's sparse " \
           "sampler too (snapkv B 12)" in capsys.readouterr().err
    assert json.loads(out.read_text())["inference"] == "dense"


# ----------------------------------------------------------------------------- eval
EVAL_ARGS = ["--n", "4", "--samples", "2", "--difficulty", "3", "--threads", "1"]


def _check_headline(part: dict, n_samples: int) -> None:
    for key in ("accuracy", "max_prompt_tokens", "max_total_tokens", "mean_response_tokens", "pass_at_k"):
        assert key in part, key
    assert 0.0 <= part["accuracy"] <= 1.0
    # pointer_walk prompt with 3 letters: "^" + 3 links of 2 chars + "|" + start + last counter = 10 characters.
    assert part["max_prompt_tokens"] == 10
    # response bound for at most 2 hops: 3*2 + 3 = 9 characters, + 6 slack = 15 new tokens at most.
    assert 1 <= part["mean_response_tokens"] <= 15
    assert part["max_prompt_tokens"] < part["max_total_tokens"] <= part["max_prompt_tokens"] + 15
    pass_k = part["pass_at_k"]
    assert set(pass_k) == {"pass@1", "pass@2"}
    assert 0.0 <= pass_k["pass@1"] <= pass_k["pass@2"] <= 1.0
    # With 2 samples, per example pass@1 = c/2 and pass@2 = [c>0]; the mean of c/2 over examples is
    # the sampled accuracy.
    assert pass_k["pass@1"] == pytest.approx(part["sampled_accuracy"])


def test_eval_dense(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sub" / "dense.json"
    assert main(["eval", "--out", str(out), "--model", str(tiny_model_dir), *EVAL_ARGS]) == 0
    result = json.loads(out.read_text())
    assert result["inference"] == "dense"
    assert result["examples"] == 4
    assert result["max_new_tokens"] == 15
    _check_headline(result["dense"], 2)
    for key in ("accuracy", "max_prompt_tokens", "max_total_tokens", "mean_response_tokens"):
        assert result[key] == result["dense"][key]
    kv = result["dense"]["kv"]  # dense inference reports its memory too, to set against sparse
    assert kv["sparsity"] == "dense" and 0 < kv["kv_peak_bytes"] == kv["kv_dense_bytes"] and kv["rows_in_flight"] == 4
    # stdout is JSON too (the non-nested part), one entry per inference asked for.
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == ["dense"] and printed["dense"]["accuracy"] == result["accuracy"]


def test_eval_both_prints_both(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "both.json"
    assert main(["eval", "--out", str(out), "--model", str(tiny_model_dir), *EVAL_ARGS, "--inference", "both",
                 "--kv-budget", "8", "--kv-window", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    result = json.loads(out.read_text())
    assert list(printed) == ["dense", "sparse", "kv_saved"] and printed["kv_saved"] == result["kv_saved"]
    for mode in ("dense", "sparse"):
        assert printed[mode]["accuracy"] == result[mode]["accuracy"]


def test_eval_writes_every_greedy_answer_and_can_skip_the_alpha_replay(tiny_model_dir, tmp_path):
    """--answers: a line per greedy answer and inference, on the held-out prompts the task itself draws, whose
    verdicts make the reported accuracies; --alpha false leaves α out of the sparse part (and only that)."""
    from sparserl.tasks.pointer_walk import PointerWalkTask

    out, answers_file = tmp_path / "both.json", tmp_path / "answers" / "both.jsonl"
    argv = ["eval", "--out", str(out), "--model", str(tiny_model_dir), *EVAL_ARGS, "--inference", "both",
            "--kv-budget", "8", "--kv-window", "2", "--answers", str(answers_file)]
    assert main([*argv, "--alpha", "false"]) == 0
    result = json.loads(out.read_text())
    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    held_out = [e.prompt for e in PointerWalkTask(letters=3).examples(4, seed=0, split="test")]
    for mode in ("dense", "sparse"):
        mine = [a for a in answers if a["inference"] == mode]
        assert [a["prompt"] for a in mine] == held_out
        assert sum(a["correct"] for a in mine) / 4 == result[mode]["accuracy"]
        assert all(isinstance(a["completion"], str) and a["label"] for a in mine)
    assert not any(k.startswith("alpha") for k in result["sparse"])
    assert main(argv) == 0
    assert any(k.startswith("alpha") for k in json.loads(out.read_text())["sparse"])
    with_alpha = [json.loads(line) for line in answers_file.read_text().splitlines()]
    assert with_alpha == answers  # greedy answers do not depend on the replay


def test_eval_sparse(tiny_model_dir, tmp_path):
    out = tmp_path / "sparse.json"
    argv = ["eval", "--out", str(out), "--model", str(tiny_model_dir), *EVAL_ARGS,
            "--kv-budget", "8", "--kv-interval", "2", "--kv-window", "2"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["inference"] == "sparse"
    part = result["sparse"]
    _check_headline(part, 2)
    kv = part["kv"]
    assert kv["budget"] == 8 and kv["window"] == 2 and kv["interval"] == 2
    assert 0 < kv["kv_peak_bytes"] <= kv["kv_dense_bytes"]
    # Sequences of up to 30 tokens with a budget of 8 (+ interval 2) must evict something.
    assert kv["kv_peak_bytes"] < kv["kv_dense_bytes"]
    assert kv["kv_evicted_tokens_mean"] > 0


def test_eval_top_level_has_pass_at_k_and_kv(tiny_model_dir, tmp_path):
    out = tmp_path / "sparse.json"
    argv = ["eval", "--out", str(out), "--model", str(tiny_model_dir), "--n", "1", "--samples", "1",
            "--difficulty", "3", "--threads", "1", "--kv-budget", "8", "--kv-window", "2"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert "pass_at_k" in result and "kv" in result


# ----------------------------------------------------------------------------- pass@k
def _brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (the first c correct) holding at least one correct."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=1: c/n = 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(3, 0, 3) == 0.0
    assert pass_at_k(3, 1, 3) == 1.0


@pytest.mark.parametrize(("flags", "needle"), [
    (["--draft-tokens", "6"], "--draft-tokens does nothing without --speculative true"),
    (["--block-page-size", "32"], "--block-page-size does nothing without --sparsity block"),
    (["--calibration-prompts", "8"], "--calibration-prompts does nothing without --recalibrate-every N"),
    (["--worker-cpus", "2"], "--worker-cpus does nothing without --rollout-workers N"),
    (["--distill-rank", "4"], "--distill-rank does nothing without --distill-sparse true"),
    (["--sparsity", "block", "--kv-policy", "snapkv"], "--kv-policy does nothing without --sparsity eviction"),
    (["--sparsity", "block", "--kv-lambda", "0.3"], "--kv-lambda does nothing without --sparsity eviction"),
])
def test_a_training_setting_that_nothing_would_read_is_refused(capsys, tmp_path, flags, needle):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and needle in error
    assert not (tmp_path / "run").exists()
