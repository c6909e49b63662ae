"""`sparserl eval`: held-out accuracy and pass@k of a model, run or checkpoint, dense or sparse (`experiments/eval.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config.values import coerce
from .base import (
    check_output_file,
    check_ranges,
    command,
    inference_arguments,
    inference_fields,
    refuse_adaptive_schedule,
    write_json,
    write_jsonl,
)


def _arguments(sub) -> None:
    # The sampled rollouts of pass@k read the temperature; sparse inference measures α per cached-length bin.
    inference_arguments(sub, "where to write the results", inference_fields("temperature", "alpha_bin_size"))
    sub.add_argument("--samples", type=int, default=8, help="samples per prompt for pass@k (default: 8; 0: none)")
    sub.add_argument("--inference", choices=["dense", "sparse", "both"], default=None,
                     help="dense or sparse (compressed KV) decoding, or both; default dense, or sparse when a --kv-* "
                          "flag is given")
    sub.add_argument("--answers", metavar="FILE.jsonl", default=None,
                     help="also write every greedy answer (inference, prompt, label, completion, correct), a line each")
    sub.add_argument("--alpha", metavar="BOOL", type=lambda value: coerce(value, bool, "--alpha"), default=None,
                     help="under sparse inference, replay the greedy answers through the dense model for α per "
                          "cached-length bin (default: true; about twice the greedy pass's time on a real model)")


def _chosen_inference(args, overrides: dict) -> str:
    """The inference `--inference` asks for (when not given: sparse if a --kv-* flag is typed, --kv-dtype included,
    else dense), after refusing the flags dense inference would not read: a whole cache in the model's dtype keeps no
    budget and stores nothing quantized, and α compares a sparse sampler with the dense model."""
    from ..errors import ConfigError

    typed_kv = [k for k in overrides if k.startswith("kv_")]
    if args.inference == "dense" and typed_kv:
        flags = ", ".join("--" + k.replace("_", "-") for k in typed_kv)
        raise ConfigError(f"--inference dense decodes with the whole cache, so {flags} would do nothing; drop it, "
                          "or ask --inference sparse or both")
    inference = args.inference or ("sparse" if typed_kv else "dense")
    typed_alpha = [flag for flag, typed in (("--alpha", args.alpha is not None),
                                            ("--alpha-bin-size", "alpha_bin_size" in overrides)) if typed]
    if inference == "dense" and typed_alpha:
        chosen = "--inference dense" if args.inference else "dense inference (the default without --kv-* flags)"
        raise ConfigError(f"{chosen} measures no α (α compares a sparse sampler with the dense model), so "
                          f"{', '.join(typed_alpha)} would do nothing; drop it, or ask --inference sparse or both")
    return inference


@command("eval", "held-out accuracy and pass@k, dense or sparse inference", _arguments)
def _eval(args) -> int:
    from ..config.flags import overrides_from_args
    from ..experiments.eval import config_for_eval, resolve_model, run_eval

    check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1"),
                        "samples": (0, float("inf"), "samples per prompt for pass@k, 0 (none) or more")})
    check_output_file(Path(args.out), "--out", "eval.json")
    if args.answers:
        check_output_file(Path(args.answers), "--answers", "answers.jsonl")
    overrides = overrides_from_args(args)
    config = config_for_eval(args.config, overrides)
    refuse_adaptive_schedule(config, "eval")
    inference = _chosen_inference(args, overrides)
    if args.inference is None and inference == "dense" and (args.config or resolve_model(config.model.model)[1]):
        from ..report.common import sparse_sampler

        print(f"eval: dense inference (the default); --inference sparse or both decodes with the config's sparse "
              f"sampler too ({sparse_sampler(config.to_dict())})", file=sys.stderr)
    answers: list[dict] | None = [] if args.answers else None
    result = run_eval(config, n=args.n, samples=args.samples, inference=inference,
                      measure_alpha=args.alpha is not False, answers=answers)
    write_json(Path(args.out), result)
    if answers is not None:
        write_jsonl(Path(args.answers), answers, "--answers")
    # Every inference asked for, each with its flat figures (the file has the nested ones too).
    shown = {mode: {k: v for k, v in result[mode].items() if not isinstance(v, dict)}
             for mode in ("dense", "sparse") if mode in result}
    shown.update({k: result[k] for k in ("kv_saved", "kv_saved_note") if k in result})
    print(json.dumps(shown, indent=2))
    return 0
