"""The regime of a warm-started model on the running total: dense against compressed samplers, on the same prompts.

    PYTHONPATH=src python docs/results/paper_regime/measure.py --model DIR --config FILE --out DIR \
        [--n 40] [--samplers rkv:64,snapkv:64,streamingllm:64:greedy] [--samples 8] [--sample-prompts 16]
        [--no-alpha] [--set KEY=VALUE]

For the dense sampler and each compressed one (policy:budget), greedy on the `--n` held-out prompts of the config's
seed (the test split `sparserl eval` and `sweep` use), with the library's own figures (`train.evaluation`):
accuracy by the task's reward, exact walks, mean prompt and response tokens, the KV figures, and for compressed
samplers the α of the greedy rollouts against the dense model. Then, as `sparserl sweep` does, sampled rollouts
(`--samples` per prompt on the first `--sample-prompts`, the config's temperature) scored by a dense recompute:
Sparse-RL's veto rate and band rate, and quantiles of ξ = π_old / π_sparse over their tokens.

KV saved is computed here as 1 − (compressed peak bytes) / (dense peak bytes), both `kv_peak_bytes` of greedy
rollouts of the same prompts with the same rows in flight, never against the dense-equivalent bound of the
compressed run (`kv_dense_bytes`, which pads every row to the longest).

Every answer is written to answers.jsonl and read by an independent checker (`read_answer`: arithmetic from the
prompt's numbers, not the task's demonstration), which says for each wrong answer where and how it first went wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections import Counter
from pathlib import Path

import torch

from sparserl.config.corrections import CorrectionConfig
from sparserl.config.schema import load_config
from sparserl.experiments.eval import held_out
from sparserl.learner.alpha import rollout_alpha_metrics
from sparserl.learner.corrections import compute_corrections
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.sparsity.settings import sparsity_from_config
from sparserl.tasks.base import walk_metrics
from sparserl.train.evaluation import _kv_figures, _token_figures, accuracy, complete, task_rewards

ADDITION = re.compile(r"^(\d+) \+ (\d+) = (\d+)(?:; left: (.*))?$")


def read_answer(numbers: list[int], restate_every: int, answer: str) -> tuple[bool, int | None, str]:
    """(correct, first wrong line, why), by arithmetic. Line 0 is the first number, line i (1..n-1) adds numbers[i]
    to the running total, every restate_every-th such line with numbers still to add lists them after "; left: ",
    and line n is "The total is T."."""
    lines = answer.strip().split("\n")
    n = len(numbers)
    total = numbers[0]
    if not lines or lines[0].strip() != str(numbers[0]):
        return False, 0, "first number"
    for i in range(1, n):
        if i >= len(lines):
            return False, i, "answer ended"
        line = lines[i].strip()
        match = ADDITION.match(line)
        if match is None:
            return False, i, "stopped early" if line.startswith("The total is") else "malformed line"
        start, added, result, left = int(match[1]), int(match[2]), int(match[3]), match[4]
        if start != total:
            return False, i, "wrong carried total"
        if added != numbers[i]:
            return False, i, "wrong number read"
        if result != total + added:
            return False, i, "wrong sum"
        total += added
        wants = restate_every > 0 and i % restate_every == 0 and i < n - 1
        if wants != (left is not None):
            return False, i, "restatement missing" if wants else "restatement where none is due"
        if wants and left != ", ".join(map(str, numbers[i + 1:])):
            return False, i, "wrong restatement"
    if len(lines) <= n:
        return False, n, "no total line"
    if lines[n].strip() != f"The total is {total}.":
        return False, n, "ran past the list" if ADDITION.match(lines[n].strip()) else "wrong total line"
    if len(lines) > n + 1:
        return False, n + 1, "text after the total"
    return True, None, "correct"


STEP = re.compile(r"^(\d+)(?:/(\d+))?: (\d+) \+ (\d+) = (\d+)$")


def read_progression(start: int, increment: int, count: int, count_every: int,
                     answer: str) -> tuple[bool, int | None, str]:
    """(correct, first wrong line, why) for the counted progression, by arithmetic: line i (0-based) is
    "i+1: v + d = v+d" for i < count (every count_every-th line numbered "i+1/count:"), then "The result is R."."""
    lines, value = answer.strip().split("\n"), start
    for i in range(count):
        if i >= len(lines):
            return False, i, "answer ended"
        line = lines[i].strip()
        match = STEP.match(line)
        if match is None:
            return False, i, "stopped early" if line.startswith("The result is") else "malformed line"
        counter, restated, carried, added, result = match.groups()
        if int(counter) != i + 1:
            return False, i, "wrong line number"
        wants = bool(count_every) and (i + 1) % count_every == 0
        if wants != (restated is not None):
            return False, i, "count restatement missing" if wants else "count restated where none is due"
        if restated is not None and int(restated) != count:
            return False, i, "wrong count restated"
        if int(carried) != value:
            return False, i, "wrong carried value"
        if int(added) != increment:
            return False, i, "wrong increment"
        if int(result) != value + increment:
            return False, i, "wrong sum"
        value += increment
    if len(lines) <= count:
        return False, count, "no result line"
    if lines[count].strip() != f"The result is {value}.":
        return False, count, "ran past the count" if STEP.match(lines[count].strip()) else "wrong result line"
    if len(lines) > count + 1:
        return False, count + 1, "text after the result"
    return True, None, "correct"


def read(example, task_config, text: str) -> tuple[bool, int | None, str, int]:
    """The checker's verdict and the answer's expected line count (for where the first error falls)."""
    extra = example.extra
    if "numbers" in extra:
        return (*read_answer(extra["numbers"], task_config.restate_every, text), len(extra["numbers"]))
    return (*read_progression(extra["start"], extra["increment"], extra["count"], task_config.count_every, text),
            extra["count"])


def xi_quantiles(logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    log_xi = (logp_old - logp_sampler)[mask.bool()].double()
    return {f"xi_q{int(q * 100):02d}": float(torch.quantile(log_xi, q).exp()) for q in (0.01, 0.05, 0.5)}


def greedy(setup, rewards, compression, task_config, alpha: bool = True) -> tuple[dict, list[dict]]:
    started = time.perf_counter()
    done = complete(setup.model, setup.tokenizer, setup.examples, setup.max_new_tokens, 0.0, compression,
                    limits=setup.limits, record_distributions=compression is not None)
    seconds = time.perf_counter() - started
    scores = rewards.score_examples(setup.examples, done.texts, done.ids)
    result = {"accuracy": accuracy(scores), **walk_metrics(setup.task, done.texts, setup.examples),
              **_token_figures(done.batches), "kv": _kv_figures(done.batches), "greedy_seconds": round(seconds, 1)}
    if compression is not None and alpha:
        started = time.perf_counter()
        result.update(rollout_alpha_metrics(setup.model, done.batches, 0.0, 16))
        result["alpha_seconds"] = round(time.perf_counter() - started, 1)
    answers, why = [], Counter()
    lines_at = []
    for example, text, score in zip(setup.examples, done.texts, scores):
        right, line, reason, length = read(example, task_config, text)
        answers.append({**example.extra, "completion": text, "rewarded": score >= 1.0, "checker_correct": right,
                        "first_wrong_line": line, "why": reason})
        if not right:
            why[reason] += 1
            lines_at.append(line / length)
    result["checker_agrees_with_reward"] = all(a["rewarded"] == a["checker_correct"] for a in answers)
    result["first_errors"] = dict(why.most_common())
    if lines_at:  # where in the answer the first mistake falls, as a share of the list's length
        result["first_error_line_share_mean"] = sum(lines_at) / len(lines_at)
    return result, answers


def sampled(setup, compression, temperature: float, samples: int, prompts: int, seed: int) -> dict:
    started = time.perf_counter()
    done = complete(setup.model, setup.tokenizer, setup.examples[:prompts], setup.max_new_tokens, temperature,
                    compression, limits=setup.limits, samples=samples, seed=seed)
    vetoed = rows = 0.0
    old, new, masks = [], [], []
    for batch in done.batches:
        logp_old = batched_logprobs(setup.model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1],
                                    64, temperature)
        out = compute_corrections(logp_old, batch.sampler_logprobs, batch.response_mask, CorrectionConfig())
        vetoed += out.metrics["rejected_sequences"]
        rows += len(batch)
        old.append(logp_old.flatten())
        new.append(batch.sampler_logprobs.flatten())
        masks.append(batch.response_mask.flatten())
    return {"veto_frac": vetoed / max(rows, 1), "sampled_rollouts": int(rows),
            **xi_quantiles(torch.cat(old), torch.cat(new), torch.cat(masks)),
            "sampled_seconds": round(time.perf_counter() - started, 1)}


TASK_FIELDS = ("task", "operands", "min_operands", "restate_every", "progression_steps", "min_progression_steps",
               "max_increment", "count_every", "chat_template", "max_new_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--samplers", default="rkv:64")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--sample-prompts", type=int, default=16)
    parser.add_argument("--no-alpha", action="store_true", help="screening: leave out the α replay")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    args = parser.parse_args()
    overrides = {"model": args.model, "threads": "1", **dict(kv.split("=", 1) for kv in args.set)}
    config = load_config(args.config, overrides)
    setup = held_out(config, args.n)
    rewards = task_rewards(config, setup.task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "config": args.config, "overrides": overrides, "n": args.n,
              "task": {f: getattr(config.task, f) for f in TASK_FIELDS if hasattr(config.task, f)},
              "max_new_tokens": setup.max_new_tokens, "samplers": {}}
    all_answers = {}
    dense, all_answers["dense"] = greedy(setup, rewards, None, config.task)
    report["samplers"]["dense"] = dense
    print(f"dense: {dense['accuracy']:.1%} in {dense['greedy_seconds']} s", flush=True)
    for spec in args.samplers.split(","):
        policy, budget, *only = spec.split(":")  # policy:budget[:greedy], greedy: no α and no sampled rollouts
        quick = only == ["greedy"]
        rollout = dataclasses.replace(config.rollout, kv_policy=policy, kv_budget=int(budget))
        compression = sparsity_from_config(rollout)
        part, all_answers[spec] = greedy(setup, rewards, compression, config.task, alpha=not (args.no_alpha or quick))
        if args.samples > 0 and not quick:  # 0: screening, greedy only
            part.update(sampled(setup, compression, config.rollout.temperature, args.samples, args.sample_prompts,
                                config.train.seed))
        part["kv_saved_vs_dense_peak"] = 1 - part["kv"]["kv_peak_bytes"] / dense["kv"]["kv_peak_bytes"]
        part["accuracy_ratio_to_dense"] = part["accuracy"] / dense["accuracy"] if dense["accuracy"] else None
        report["samplers"][spec] = part
        print(f"{spec}: {part['accuracy']:.1%} (ratio {part['accuracy_ratio_to_dense']}), KV saved "
              f"{part['kv_saved_vs_dense_peak']:.1%}, veto {part.get('veto_frac')}, α tail {part.get('alpha_tail')}",
              flush=True)
        (out / "measure.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "measure.json").write_text(json.dumps(report, indent=2) + "\n")
    with (out / "answers.jsonl").open("w") as f:
        for spec, answers in all_answers.items():
            for a in answers:
                f.write(json.dumps({"sampler": spec, **a}) + "\n")


if __name__ == "__main__":
    main()
