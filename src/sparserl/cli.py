"""The `sparserl` command: warmup, train, eval and compare.

    sparserl warmup --out DIR                     # supervised warm start of the built-in model
    sparserl train --out DIR --steps N --mode MODE --seed S [--config FILE] [--resume]
    sparserl eval --out FILE.json [--model DIR] [--n N]
    sparserl compare --out DIR [--config FILE]

Every configuration field is a flag (see `sparserl train --help`); a YAML file given with
--config is applied first and flags override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
import warnings
from pathlib import Path

from .config import ConfigError, add_config_arguments, coerce, load_config, overrides_from_args
from .models import ModelFilesError

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Our own bars show progress; transformers' per-load and per-save bars would drown them.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.simplefilter("default")
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"sparserl: config error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelFilesError, ValueError, FileNotFoundError) as error:
        # User-facing problems (bad data line, missing model files, bad option) get one clear line;
        # SPARSERL_DEBUG=1 shows the traceback instead.
        if os.environ.get("SPARSERL_DEBUG"):
            raise
        print(f"sparserl: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    warm = commands.add_parser("warmup", help="warm-start the built-in model by supervised learning")
    from .warmup import WarmupConfig

    _add_dataclass_arguments(warm, WarmupConfig)
    warm.set_defaults(handler=_warmup)

    train = commands.add_parser("train", help="train a policy with GRPO (dense or sparse rollouts)")
    train.add_argument("--config", metavar="FILE", help="YAML config applied before the flags")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    add_config_arguments(train)
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser("eval", help="held-out accuracy and pass@k, dense or sparse inference")
    evaluate.add_argument("--config", metavar="FILE", help="YAML config applied before the flags")
    evaluate.add_argument("--out", required=True, metavar="FILE.json", help="where to write the results")
    evaluate.add_argument("--n", type=int, default=200, help="held-out examples (default: 200)")
    evaluate.add_argument("--samples", type=int, default=8, help="samples per example for pass@k (default: 8)")
    evaluate.add_argument("--inference", choices=["dense", "sparse", "both"], default=None,
                          help="dense or sparse (compressed KV) decoding; default dense, or sparse when "
                               "a --kv-* flag is given")
    add_config_arguments(evaluate, skip=("out",))
    evaluate.set_defaults(handler=_eval)

    compare = commands.add_parser("compare", help="run dense, naive-sparse, sparse-rl (and ablations) and report")
    compare.add_argument("--config", metavar="FILE", help="YAML config applied before the flags")
    compare.add_argument("--modes", default="dense,naive-sparse,sparse-rl",
                         help="comma-separated modes to run (default: dense,naive-sparse,sparse-rl; "
                              "add sparse-tis,sparse-rs for the ablations)")
    add_config_arguments(compare)
    compare.set_defaults(handler=_compare)
    return parser


def _add_dataclass_arguments(parser: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, list):
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f"dc__{f.name}", default=None,
                            help=f"(default: {default})", metavar=hints[f.name].__name__.upper())


def _warmup(args) -> int:
    from .warmup import WarmupConfig, warmup

    hints = typing.get_type_hints(WarmupConfig)
    values = {k[4:]: coerce(v, hints[k[4:]], k[4:]) for k, v in vars(args).items()
              if k.startswith("dc__") and v is not None}
    card = warmup(WarmupConfig(**values))
    print(json.dumps({k: v for k, v in card.items() if k not in ("probes", "settings")}, indent=2))
    return 0


def _train(args) -> int:
    from .trainer import GRPOTrainer

    config = load_config(args.config, overrides_from_args(args))
    state = GRPOTrainer(config, resume=args.resume).train()
    print(f"done: {state.step} steps in {config.output.out} "
          f"(metrics.jsonl, tensorboard/, checkpoints/; skipped updates: {state.skipped_steps})")
    return 0


def _eval(args) -> int:
    from .evaluate import run_eval

    overrides = overrides_from_args(args)
    config = load_config(args.config, overrides)
    inference = args.inference or ("sparse" if any(k.startswith("kv_") for k in overrides) else "dense")
    result = run_eval(config, n=args.n, samples=args.samples, inference=inference)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    return 0


def _compare(args) -> int:
    from .compare import run_compare

    config = load_config(args.config, overrides_from_args(args))
    run_compare(config, [m.strip() for m in args.modes.split(",") if m.strip()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
