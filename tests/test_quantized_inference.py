"""Sparse inference through a quantized KV cache (`--kv-dtype`): `sparserl eval`, `sparserl sweep --kv-dtypes`, the
trainer's and compare's held-out evaluation and the calibration sample through the run's KV storage, checked against
direct engine calls and against bytes worked out by hand from the model's shapes."""

from __future__ import annotations

import json

import pytest
import torch

from sparserl.cli import main
from sparserl.config.schema import load_config
from sparserl.experiments.eval import held_out, run_eval
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.train import evaluation

torch.set_num_threads(1)

NEW = 8  # a response bound every built-in walk runs past: every row decodes all NEW tokens


def _shapes(model) -> tuple[int, int, int]:
    config = model.config
    return (config.num_hidden_layers, config.num_key_value_heads,
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def test_the_sweeps_kv_saved_by_a_quantized_cache_is_the_bytes_worked_out_by_hand(tmp_path):
    """Built-in model, float32, every row at once to NEW tokens: a dense cache of C = prompt width + NEW slots holds
    rows x layers x C x 2 x Hkv x D x 4 bytes; fp8 one byte an element plus each row's 2 x Hkv float32 scales per
    layer; int8 one byte an element, a float32 value scale per slot and KV head, and Hkv x D float32 key scales per
    row and layer. KV saved is against the dense float32 cache."""
    out = tmp_path / "sweep.json"
    n = 8
    assert main(["sweep", "--out", str(out), "--budgets", "4096", "--kv-dtypes", "auto,fp8,int8", "--n", str(n),
                 "--sample-prompts", "2", "--samples", "2", "--threads", "1", "--difficulty", "12",
                 "--max-new-tokens", str(NEW)]) == 0
    result = json.loads(out.read_text())
    config = load_config(None, {"difficulty": 12, "max_new_tokens": NEW, "threads": 1})
    setup = held_out(config, n)
    layers, heads, dim = _shapes(setup.model)
    width = max(len(setup.tokenizer(e.prompt).input_ids) for e in setup.examples)
    slots = n * layers * (width + NEW)
    dense = slots * 2 * heads * dim * 4
    expected = {"fp8": slots * 2 * heads * dim + n * layers * 2 * heads * 4,
                "int8": slots * (2 * heads * dim + heads * 4) + n * layers * heads * dim * 4}
    assert result["dense"]["kv_peak_bytes"] == dense and result["dense"]["rows_in_flight"] == n
    rows = {(r["kv_dtype"], r["budget"]): r for r in result["rows"]}
    assert list(rows) == [("auto", 4096), ("fp8", None), ("fp8", 4096), ("int8", None), ("int8", 4096)]
    for kv_dtype, peak in expected.items():
        for budget in (None, 4096):  # a budget no row reaches evicts nothing: the same cache
            row = rows[kv_dtype, budget]
            assert row["kv_peak_bytes"] == peak and row["rows_in_flight"] == n
            assert row["kv_saved"] == pytest.approx(1 - peak / dense, abs=1e-12)
            assert row["kv_kept_frac"] == 1
    assert rows["fp8", None]["kv_saved"] > 0.74 and rows["auto", 4096]["kv_saved"] == 0
    # The numerics baseline: the dense sampler against the dense recompute, float rounding alone.
    floor = result["dense"]
    assert floor["veto_frac"] == 0 and floor["xi_q01"] == pytest.approx(1, abs=1e-4)
    assert rows["auto", 4096]["xi_q01"] == floor["xi_q01"]  # a budget never reached is the dense sampler, bitwise
    table = (tmp_path / "sweep.md").read_text()
    assert "| dense (numerics baseline) | auto |" in table and "| none (no eviction) | fp8 |" in table
    assert result["model_dtype"] == "float32" and result["paper_regime_budget"] == 4096


@pytest.mark.parametrize("flags, message", [
    (["--sparsity", "block", "--kv-dtypes", "auto,fp8"],
     "--kv-dtypes fp8: --kv-dtype fp8 does not combine with --sparsity block"),
    (["--kv-dtypes", "auto,fp16"], "--kv-dtypes 'auto,fp16': give one or more of auto, fp8, int8"),
    (["--kv-dtypes", "fp8,fp8"], "each at most once"),
])
def test_the_sweep_refuses_storages_it_cannot_run_in_one_line(tmp_path, capsys, flags, message):
    assert main(["sweep", "--out", str(tmp_path / "s.json"), "--budgets", "64", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_eval_refuses_a_quantized_cache_under_block_attention(tmp_path, capsys):
    assert main(["eval", "--out", str(tmp_path / "e.json"), "--kv-dtype", "int8", "--sparsity", "block"]) == 2
    assert "--kv-dtype int8 does not combine with --sparsity block" in capsys.readouterr().err


def test_eval_samples_sparse_inference_through_the_quantized_cache():
    """`eval` with kv_dtype fp8 under R-KV: its greedy answers and peak bytes are a direct engine call's with the fp8
    cache; with no eviction (a budget past every row) auto is the dense sampler (α 1) and fp8 is not."""
    n = 12
    config = load_config(None, {"kv_dtype": "fp8", "kv_budget": 24, "threads": 1, "difficulty": 12})
    answers: list[dict] = []
    report = run_eval(config, n=n, samples=0, inference="sparse", answers=answers)
    setup = held_out(config, n)
    engine = RolloutEngine(setup.model, KVCompression.from_rollout_config(config.rollout), record_evictions=False,
                           kv_dtype="fp8")
    prompts = [setup.tokenizer(e.prompt).input_ids for e in setup.examples]
    batch = engine.generate(prompts, SamplingConfig(setup.max_new_tokens, 0.0, setup.tokenizer.eos_token_id,
                                                    setup.tokenizer.pad_token_id))
    assert [a["completion"] for a in answers] == evaluation.decode_responses(setup.tokenizer, batch)
    kv = report["sparse"]["kv"]
    assert kv["kv_dtype"] == "fp8" and kv["kv_peak_bytes"] == batch.kv.kv_peak_bytes
    layers, heads, dim = _shapes(setup.model)
    assert kv["kv_slot_bytes"] == batch.kv.kv_slot_bytes == layers * 2 * heads * dim

    unbound = {"kv_budget": 4096, "threads": 1, "difficulty": 12}
    auto = run_eval(load_config(None, unbound), n=n, samples=0, inference="sparse")["sparse"]
    fp8 = run_eval(load_config(None, {**unbound, "kv_dtype": "fp8"}), n=n, samples=0, inference="sparse")["sparse"]
    assert auto["alpha_mean"] == pytest.approx(1, abs=1e-6) and fp8["alpha_mean"] < auto["alpha_mean"] - 1e-4
    assert fp8["kv"]["kv_peak_bytes"] < auto["kv"]["kv_peak_bytes"] / 3.9


def _recording_engines(monkeypatch) -> list[tuple[object, str]]:
    """Every engine the evaluation builds, as (its sparsity, its kv_dtype)."""
    built: list[tuple[object, str]] = []
    real = evaluation.RolloutEngine

    def engine(model, compression=None, **kwargs):
        built.append((compression, kwargs.get("kv_dtype", "auto")))
        return real(model, compression, **kwargs)

    monkeypatch.setattr(evaluation, "RolloutEngine", engine)
    return built


def test_the_trainers_and_compares_sparse_inference_use_the_runs_kv_storage(tiny_model_dir, tmp_path, monkeypatch):
    built = _recording_engines(monkeypatch)
    out = tmp_path / "cmp"
    assert main(["compare", "--model", str(tiny_model_dir), "--out", str(out), "--modes", "naive-sparse",
                 "--steps", "1", "--seed", "1", "--prompts-per-step", "2", "--group-size", "2", "--difficulty", "4",
                 "--eval-examples", "4", "--eval-every", "1", "--threads", "1", "--kv-budget", "10",
                 "--kv-window", "3", "--kv-interval", "3", "--log-with", "none", "--kv-dtype", "int8"]) == 0
    # step 0 and step 1 (the trainer), then the final evaluation: dense in the model's dtype, sparse through R-KV
    # stored in int8; never a sparse evaluation in the model's dtype
    assert [(c is not None, d) for c, d in built] == [(False, "auto"), (True, "int8")] * 3
    final = json.loads((out / "naive-sparse" / "seed1" / "final_eval.json").read_text())
    assert final["sparse"]["kv"]["kv_dtype"] == "int8" and final["dense"]["kv"]["kv_dtype"] == "auto"
    assert final["sparse"]["kv"]["kv_slot_bytes"] < final["dense"]["kv"]["kv_slot_bytes"] / 3


def test_the_calibration_samples_through_the_kv_storage(monkeypatch):
    from sparserl.train import calibration

    seen: list[str] = []
    real = calibration.complete

    def complete(*args, **kwargs):
        seen.append(kwargs.get("kv_dtype", "auto"))
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "complete", complete)
    config = load_config(None, {"kv_dtype": "fp8", "threads": 1, "difficulty": 12, "max_new_tokens": NEW})
    setup = held_out(config, 0)
    examples = setup.task.examples(2, seed=0, split="train")
    calibration.calibrate_schedule(setup.model, setup.tokenizer, NEW, config.rollout, examples, [4096], 0.5, 64, 1,
                                   0, progress=False)
    assert seen and set(seen) == {"fp8"}


def test_the_audit_samples_through_the_kv_storage(tmp_path):
    out = tmp_path / "audit.json"
    assert main(["audit", "--out", str(out), "--kv-budget", "4096", "--kv-dtype", "int8", "--n", "8", "--threads",
                 "1", "--difficulty", "12"]) == 0
    kv = json.loads(out.read_text())["kv"]
    assert kv["kv_dtype"] == "int8" and kv["kv_slot_bytes"] == 3 * (2 * 2 * 32 + 2 * 4)  # built-in: 3 layers, 2 x 32


def test_nemo_fp8_trains_through_a_full_fp8_cache_with_token_tis_at_two(tmp_path):
    """The field's preset on the built-in model: nothing evicted, every slot one byte an element (3 layers x K and V x
    2 KV heads x 32), ξ measured against the dense recompute, and each token's weight min(ξ, 2), not normalised."""
    out = tmp_path / "run"
    assert main(["train", "--mode", "nemo-fp8", "--out", str(out), "--steps", "1", "--prompts-per-step", "2",
                 "--group-size", "4", "--difficulty", "12", "--max-new-tokens", "24", "--eval-every", "0",
                 "--threads", "1", "--log-with", "none"]) == 0
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"reward_mean"' in line][0]
    assert record["kv_slot_bytes"] == 3 * 2 * 2 * 32 and record["kv_compressions"] == 0
    assert record["kv_kept_frac"] == 1 and record["kv_evicted_tokens_mean"] == 0
    assert record["xi_min"] < 1 - 1e-4  # the fp8 cache is a mismatch, measured
    assert record["rejected_sequences"] == 0 and record["kept_token_frac"] == 1
    assert record["weight_max"] == pytest.approx(min(record["xi_max"], 2.0), rel=1e-6)
    assert record["is_batch_norm_factor"] == 1


def test_a_dense_mode_is_refused_a_quantized_sampler_and_budget_commands_a_full_cache(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--mode", "dense", "--kv-dtype", "fp8", "--steps", "1"]) == 2
    assert "mode dense samples densely and corrects nothing" in capsys.readouterr().err
    for command in (["audit", "--kv-dtype", "fp8"], ["sweep", "--budgets", "64", "--kv-dtypes", "fp8"]):
        assert main([*command, "--out", str(tmp_path / "x.json"), "--sparsity", "none",
                     "--n", "2", "--threads", "1"]) == 2
        error = capsys.readouterr().err.strip()
        assert f"sparserl {command[0]} works on a KV budget, and --sparsity none keeps every token" in error


def test_compare_gives_dense_the_whole_cache_and_each_preset_its_own_sampler(tiny_model_dir, tmp_path):
    """`--kv-dtype int8` is for the sparse modes: the dense baseline samples in the model's dtype; nemo-fp8 brings its
    full fp8 cache, and the comparison extends in either order of modes."""
    import yaml

    out = tmp_path / "cmp"
    common = ["--model", str(tiny_model_dir), "--out", str(out), "--steps", "1", "--prompts-per-step", "2",
              "--group-size", "2", "--difficulty", "4", "--eval-examples", "4", "--threads", "1", "--kv-budget", "10",
              "--kv-window", "3", "--kv-interval", "3", "--log-with", "none"]
    assert main(["compare", "--modes", "dense,naive-sparse", "--kv-dtype", "int8", *common]) == 0
    assert main(["compare", "--modes", "nemo-fp8,dense", "--kv-dtype", "int8", *common]) == 0
    rollout = {mode: yaml.safe_load((out / mode / "seed0" / "config.yaml").read_text())["rollout"]
               for mode in ("dense", "naive-sparse", "nemo-fp8")}
    assert rollout["dense"]["kv_dtype"] == "auto" and rollout["naive-sparse"]["kv_dtype"] == "int8"
    assert (rollout["nemo-fp8"]["sparsity"], rollout["nemo-fp8"]["kv_dtype"]) == ("none", "int8")  # the flag wins
    final = json.loads((out / "nemo-fp8" / "seed0" / "final_eval.json").read_text())
    assert final["sparse"]["kv"]["sparsity"] == "none" and final["sparse"]["kv"]["kv_dtype"] == "int8"
