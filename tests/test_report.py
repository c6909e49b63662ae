"""The compare report: plots exist, table cells equal hand-computed numbers, findings classify correctly."""

from __future__ import annotations

import json

import pytest

from sparserl.report import PLOTS, classify_trajectory, paper_table, write_report

MIB = 1024 ** 2


def _step(step: int, reward: float, kept: float, vetoed: float, peak_mib: float, **extra) -> dict:
    record = {"step": step, "reward_mean": reward, "reward_std": 0.1, "accuracy": reward,
              "response_len_mean": 40.0 + step, "rollout_s": 2.0, "step_s": 5.0,
              "kv_peak_bytes": int(peak_mib * MIB), "kv_dense_bytes": 4 * MIB, "kv_kept_frac": kept,
              "xi_mean": 1.0, "xi_min": 0.01 * step, "xi_q01": 0.5, "kl_sampler_old": 0.02 * step,
              "veto_frac": vetoed / 8, "band_mask_frac": 0.1, "ess": 0.9, "vetoed_sequences": vetoed,
              "skipped": 0, "skipped_steps": 0, "veto_frac_len_0_16": 0.0, "veto_frac_len_16_inf": vetoed / 4}
    record.update(extra)
    return record


def _write_run(root, mode, kept, final_dense, final_sparse, rewards=(0.5, 0.6, 0.7, 0.8), vetoed=(0, 1, 2, 1),
               peak_mib=1.6, final=True, skipped_last=0):
    run = root / mode
    run.mkdir()
    records = [{"step": 0, "eval_accuracy_dense": 0.5, "eval_accuracy_sparse": 0.3}]
    for i, (reward, k, v) in enumerate(zip(rewards, kept, vetoed), start=1):
        extra = {"eval_accuracy_dense": final_dense, "eval_accuracy_sparse": final_sparse} if i in (2, 4) else {}
        if i == 4:
            extra.update(skipped=skipped_last, skipped_steps=skipped_last)
        records.append(_step(i, reward, k, v, peak_mib, **extra))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if final:
        kv = {"kv_peak_bytes": int(peak_mib * MIB), "kv_dense_bytes": 4 * MIB, "kept_token_frac": 0.99,
              "kv_peak_frac": peak_mib / 4}
        (run / "final_eval.json").write_text(json.dumps({
            "mode": mode, "dense": {"accuracy": final_dense, "mean_response_tokens": 44.0},
            "sparse": {"accuracy": final_sparse, "mean_response_tokens": 43.0, "kv": kv},
            "train_seconds": 100.0, "rollout_seconds": 40.0, "steps": 4}))


def _compare_dir(tmp_path, rl_dense=0.78, rl_sparse=0.45, rl_kept=(0.45, 0.40, 0.40, 0.35)):
    config = {"task": {"task": "pointer_walk", "difficulty": 12}, "train": {"steps": 4, "seed": 7},
              "rollout": {"kv_policy": "rkv", "kv_budget": 32, "kv_window": 8, "kv_interval": 8,
                          "prompts_per_step": 4, "group_size": 8}}
    (tmp_path / "compare.json").write_text(json.dumps(
        {"modes": ["dense", "naive-sparse", "sparse-rl", "sparse-rs"], "config": config,
         "started": "2025-01-01T00:00:00"}))
    _write_run(tmp_path, "dense", (1.0,) * 4, 0.80, 0.40, peak_mib=4.0)
    # naive-sparse collapses: 0.20 is below half of its step-0 accuracy 0.50.
    _write_run(tmp_path, "naive-sparse", (0.4,) * 4, 0.20, 0.10, rewards=(0.5, 0.3, 0.1, 0.0), skipped_last=2)
    _write_run(tmp_path, "sparse-rl", rl_kept, rl_dense, rl_sparse)
    return tmp_path


def _rows(table: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return {r[0]: r[1:] for r in rows}


def test_report_files_table_and_findings(tmp_path):
    out = _compare_dir(tmp_path)
    report = write_report(out)
    assert report == out / "report.md"
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", name
    text = report.read_text()
    for name in PLOTS:
        assert f"]({name})" in text
    assert "pointer_walk" in text and "seed 7" in text and "budget 32" in text

    rows = _rows(paper_table(out))
    # sparse-rl: kept = mean(0.45, 0.40, 0.40, 0.35) = 40.0%, saved 60.0%; peak 1.6 MiB of 4 MiB;
    # final reward = mean of last ceil(4/10)=1 step = 0.8; vetoed mean = (0+1+2+1)/4 = 1.0.
    assert rows["sparse-rl"] == ["78.0%", "45.0%", "50.0% / 30.0%", "40.0%", "60.0%", "1.60 / 4.00",
                                 "40.0", "100.0 s", "0.800", "1.00", "0"]
    assert rows["dense"][3:6] == ["100.0%", "0.0%", "4.00 / 4.00"]
    assert rows["naive-sparse"][0] == "20.0%" and rows["naive-sparse"][-1] == "2"
    assert rows["sparse-rs (not run)"] == ["—"] * 11
    assert "sparse-rs (not run)" in text

    # mismatch table: xi_min is the minimum over steps (0.01), kl the mean (0.02*2.5 = 0.05).
    mismatch = _rows(text.split("## Mismatch metrics")[1].split("\n\n")[1])
    assert mismatch["sparse-rl"][1] == "0.01" and mismatch["sparse-rl"][2] == "0.05"
    lengths = _rows(text.split("## Sequence rejection")[1].split("\n\n")[1])
    assert lengths["sparse-rl"] == ["0.000", "0.250"]  # mean of vetoed/4 = 1.0/4

    findings = text.split("## Findings")[1]
    assert "naive-sparse final accuracy vs its start (dense inference): **collapsed**" in findings
    assert "sparse-rl reaches 97.5% of dense held-out accuracy" in findings
    assert "with 60.0% fewer KV tokens" in findings
    assert "of dense accuracy — **met** (97.5%)" in findings
    assert "fewer KV tokens — **met** (60.0% fewer)" in findings
    assert "scores 45.0% vs the dense-trained model's 40.0%" in findings
    assert "dense-trained under sparse inference — **met**" in findings


def test_targets_not_met(tmp_path):
    out = _compare_dir(tmp_path, rl_dense=0.70, rl_sparse=0.35, rl_kept=(0.6,) * 4)
    findings = write_report(out).read_text().split("## Findings")[1]
    assert "of dense accuracy — **not met** (87.5%)" in findings
    assert "fewer KV tokens — **not met** (40.0% fewer)" in findings
    assert "under sparse inference — **not met**" in findings
    assert "sparse-rl final accuracy vs its start (dense inference): **improved**" in findings


def test_incomplete_and_missing_runs(tmp_path):
    out = _compare_dir(tmp_path)
    (out / "sparse-rl" / "final_eval.json").unlink()
    (out / "naive-sparse" / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy_dense": 0.5}\n{"step": 1, "rew')
    text = write_report(out).read_text()
    rows = _rows(paper_table(out))
    # Incomplete: held-out accuracy falls back to the latest in-training evaluation (step 4 here).
    assert rows["sparse-rl (incomplete)"][0] == "78.0%"
    assert rows["sparse-rl (incomplete)"][7] == "20.0 s"  # sum of step_s, no train_seconds
    assert "naive-sparse" in text and all((out / p).exists() for p in PLOTS)


def test_kv_falls_back_to_final_eval(tmp_path):
    out = _compare_dir(tmp_path)
    path = out / "sparse-rl" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("kv_")}) + "\n"
                            for r in records))
    assert _rows(paper_table(out))["sparse-rl"][3:5] == ["99.0%", "1.0%"]


@pytest.mark.parametrize("start, final, label", [(0.5, 0.24, "collapsed"), (0.5, 0.44, "degraded"),
                                                 (0.5, 0.47, "held"), (0.5, 0.56, "improved")])
def test_classify_trajectory(start, final, label):
    assert classify_trajectory(start, final) == label
