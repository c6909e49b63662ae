"""`sparserl train`: one GRPO run, dense or sparse rollouts, resumable (`train/trainer.py`)."""

from __future__ import annotations

from pathlib import Path

from ..config.values import coerce
from .base import command, common_arguments, config_from_args, refuse_idle_weight_flags


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments

    common_arguments(sub)
    sub.add_argument("--resume", nargs="?", const="must", default="never", choices=["auto", "must"], metavar="auto",
                     help="continue the run in --out from its latest intact checkpoint (an error if there is none); "
                          "--resume auto starts from scratch when there is none")
    sub.add_argument("--overwrite", nargs="?", const=True, default=False, metavar="BOOL",
                     type=lambda value: coerce(value, bool, "--overwrite"),
                     help="delete the run already in --out (only the files a run writes) and start again")
    sub.add_argument("--allow-config-change", action="store_true",
                     help="let --resume continue with settings that differ from the run's (listed in a warning); "
                          "steps, checkpointing, evaluation cadence, logging and threads may always change")
    add_config_arguments(sub)


@command("train", "train a policy with GRPO (dense or sparse rollouts)", _arguments)
def _train(args) -> int:
    from ..train.layout import CHECKPOINT_DIR, METRICS_FILE, TENSORBOARD_DIR
    from ..train.trainer import GRPOTrainer

    config = config_from_args(args)
    refuse_idle_weight_flags(args, [config])
    trainer = GRPOTrainer(config, resume=args.resume, overwrite=args.overwrite,
                          allow_config_change=args.allow_config_change)
    state = trainer.train()
    out = Path(config.output.out)
    written = [name + "/" * (out / name).is_dir() for name in (METRICS_FILE, TENSORBOARD_DIR, CHECKPOINT_DIR)
               if (out / name).exists()]
    print(f"done: {state.step} steps in {out} ({', '.join(written)}; skipped updates: {state.skipped_steps}; "
          f"steps that rejected most tokens: {state.starving_steps})")
    return 0
