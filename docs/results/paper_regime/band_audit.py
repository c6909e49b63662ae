"""Where Sparse-RL's filters fall in sampled counted-progression rollouts: on the token where a wrong answer first
went wrong, or elsewhere.

    PYTHONPATH=src python docs/results/paper_regime/band_audit.py --model DIR --config FILE --out FILE.json \
        [--prompts 16] [--samples 8] [--set KEY=VALUE]

GRPO gives a wrong answer a negative advantage on all its tokens; what makes it wrong is its first error (a wrong
digit, a result line where a line was due). If the sparse sampler wrote that token where the dense policy would not
have, ξ = π_dense / π_sparse is small there, and Sparse-RL's band [0.5, 1.5] drops it from the loss (its veto at
1e-4 drops the whole answer): the error escapes its penalty, while the answer's correct tokens keep theirs. This
script measures how often. It samples `--samples` rollouts per held-out prompt (the config's sampler, temperature
and seed), recomputes them with the dense model, applies `CorrectionConfig.sparse_rl()`, and finds each wrong
answer's first error as the first character where it leaves the exact answer (the task's demonstration, rebuilt
from the prompt's numbers). It reports ξ at those tokens, how many the band or the veto removed, and the share of
every other response token they removed, and how many answers hold any token with ξ < 0.5 (what a band applied to
whole sequences would drop).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparserl.config.corrections import CorrectionConfig
from sparserl.config.schema import load_config
from sparserl.experiments.eval import held_out
from sparserl.learner.corrections import compute_corrections, token_ratios
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.sparsity.settings import sparsity_from_config
from sparserl.tasks.counted_progression import demonstration
from sparserl.train.evaluation import complete, response_ids


def first_error_token(tokenizer, ids: list[int], expected: str) -> int | None:
    """Index of the response token holding the first character where the decoded response leaves `expected`
    (None for the exact answer); a response that stops short of it errs at its last token (the end)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text.strip() == expected:
        return None
    at = next((i for i, (got, want) in enumerate(zip(text, expected)) if got != want), min(len(text), len(expected)))
    for k in range(1, len(ids) + 1):  # the first prefix that reaches past the diverging character
        if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) > at:
            return k - 1
    return len(ids) - 1


def audit(setup, compression, temperature: float, samples: int, seed: int, count_every: int) -> dict:
    done = complete(setup.model, setup.tokenizer, setup.examples, setup.max_new_tokens, temperature, compression,
                    limits=setup.limits, samples=samples, seed=seed)
    batch = done.batches[0]
    logp_old = batched_logprobs(setup.model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1], 16,
                                temperature)
    corrections = compute_corrections(logp_old, batch.sampler_logprobs, batch.response_mask,
                                      CorrectionConfig.sparse_rl())
    xi = token_ratios(logp_old, batch.sampler_logprobs, batch.response_mask).xi  # as the corrections read it
    kept = corrections.keep_mask.bool()
    at_error = torch.zeros_like(kept)
    errors, correct_rows = [], []
    for row, ids in enumerate(response_ids(batch)):
        extra = setup.examples[row // samples].extra
        token = first_error_token(setup.tokenizer, ids, demonstration(extra["start"], extra["increment"],
                                                                       extra["count"], count_every))
        if token is None:
            correct_rows.append(row)
            continue
        at_error[row, token] = True
        errors.append({"xi": float(xi[row, token]), "kept": bool(kept[row, token]),
                       "sequence_vetoed": not bool(corrections.seq_keep[row]),
                       "token": setup.tokenizer.decode([ids[token]]),
                       "context": setup.tokenizer.decode(ids[max(0, token - 8):token + 1])})
    response = batch.response_mask.bool()
    others, below_half = response & ~at_error, response & (xi < 0.5)
    n, correct = max(len(errors), 1), len(correct_rows)
    return {
        "rollouts": len(batch), "correct": correct, "wrong": len(errors),
        "error_tokens_removed": sum(not e["kept"] for e in errors) / n,
        "error_tokens_in_vetoed_sequences": sum(e["sequence_vetoed"] for e in errors) / n,
        "error_tokens_xi_below_half": sum(e["xi"] < 0.5 for e in errors) / n,
        "error_tokens_xi_above_1_5": sum(e["xi"] > 1.5 for e in errors) / n,
        "error_tokens_xi_median": float(torch.tensor([e["xi"] for e in errors]).median()) if errors else None,
        "other_tokens_removed": float((others & ~kept).sum() / others.sum()),
        "other_tokens_xi_below_half": float((others & below_half).sum() / others.sum()),
        "kept_token_frac": float((response & kept).sum() / response.sum()),
        # a band at the sequence's scope (drop every answer holding a token with ξ < 0.5) would drop these:
        "sequences_with_xi_below_half": float(below_half.any(dim=1).double().mean()),
        "correct_sequences_with_xi_below_half": float(below_half[correct_rows].any(dim=1).sum()) / max(correct, 1),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    args = parser.parse_args()
    overrides = {"model": args.model, "threads": "1", **dict(kv.split("=", 1) for kv in args.set)}
    config = load_config(args.config, overrides)
    setup = held_out(config, args.prompts)
    result = audit(setup, sparsity_from_config(config.rollout), config.rollout.temperature, args.samples,
                   config.train.seed, config.task.count_every)
    report = {"model": args.model, "config": args.config, "overrides": overrides, "prompts": args.prompts,
              "samples": args.samples, "temperature": config.rollout.temperature, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, indent=2))


if __name__ == "__main__":
    main()
