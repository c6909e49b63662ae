"""How the sampling temperature moves Sparse-RL's filters (issue 54, item 3): the share of response tokens and of
sequences that the band [0.5, 1.5] and the 1e-4 veto touch, for the same warm start, prompts and sparse sampler at
each temperature.

    PYTHONPATH=src python docs/results/paper_regime/temperature_filters.py --model DIR --config FILE --out FILE.json \
        [--temperatures 0.5,1.0] [--prompts 16] [--samples 8]

Both log-probs are of the tempered distributions (the sampler's, and the dense recompute's at the same temperature,
as training computes π_old), so ξ = π_dense / π_sparse at temperature T compares p^(1/T) renormalised: for a token
off the top choice log ξ scales roughly as 1/T, and the fixed band and veto bite harder at low T.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sparserl.config.schema import load_config
from sparserl.experiments.eval import held_out
from sparserl.learner.corrections import token_ratios
from sparserl.model.forward import batched_logprobs
from sparserl.rollout.sparsity.settings import sparsity_from_config
from sparserl.train.evaluation import complete

BAND, VETO = (0.5, 1.5), 1e-4


def filter_shares(setup, compression, temperature: float, samples: int, seed: int) -> dict:
    done = complete(setup.model, setup.tokenizer, setup.examples, setup.max_new_tokens, temperature, compression,
                    limits=setup.limits, samples=samples, seed=seed)
    batch = done.batches[0]
    logp_old = batched_logprobs(setup.model, batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1], 16,
                                temperature)
    ratios = token_ratios(logp_old, batch.sampler_logprobs, batch.response_mask)
    response = batch.response_mask.bool()
    has_response = response.any(dim=1)
    outside_band = response & ((ratios.xi < BAND[0]) | (ratios.xi > BAND[1]))
    vetoed = response & (ratios.log_ratio < math.log(VETO))  # the unclamped ratio, as the corrections read it
    xi = ratios.xi[response].double()
    tokens, sequences = response.sum().item(), has_response.sum().item()
    return {
        "temperature": temperature, "rollouts": len(batch), "response_tokens": tokens,
        "band_token_share": outside_band.sum().item() / tokens,
        "band_sequence_share": outside_band.any(dim=1).sum().item() / sequences,
        "veto_token_share": vetoed.sum().item() / tokens,
        "veto_sequence_share": vetoed.any(dim=1).sum().item() / sequences,
        "xi_q01": float(xi.quantile(0.01)), "xi_q05": float(xi.quantile(0.05)), "xi_q99": float(xi.quantile(0.99)),
        "mean_response_tokens": tokens / sequences,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--temperatures", default="0.5,1.0")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config, {"model": args.model, "threads": "1"})
    setup = held_out(config, args.prompts)
    rows = [filter_shares(setup, sparsity_from_config(config.rollout), float(t), args.samples, config.train.seed)
            for t in args.temperatures.split(",")]
    report = {"model": args.model, "config": args.config, "prompts": args.prompts, "samples": args.samples,
              "band": BAND, "veto": VETO, "by_temperature": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'T':>4} {'band tok':>9} {'band seq':>9} {'veto tok':>9} {'veto seq':>9} {'xi q01':>8} {'len':>6}")
    for r in rows:
        print(f"{r['temperature']:4.2f} {r['band_token_share']:9.2%} {r['band_sequence_share']:9.2%} "
              f"{r['veto_token_share']:9.3%} {r['veto_sequence_share']:9.2%} {r['xi_q01']:8.3f} "
              f"{r['mean_response_tokens']:6.1f}")


if __name__ == "__main__":
    main()
