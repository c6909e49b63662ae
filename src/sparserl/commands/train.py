"""`sparserl train`: one GRPO run, dense or sparse rollouts, resumable (`train/trainer.py`)."""

from __future__ import annotations

from .base import command, common_arguments, config_from_args


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments

    common_arguments(sub)
    sub.add_argument("--resume", nargs="?", const="must", default="never", choices=["auto", "must"], metavar="auto",
                     help="continue the run in --out from its latest intact checkpoint (an error if there is none); "
                          "--resume auto starts from scratch when there is none")
    sub.add_argument("--overwrite", action="store_true", help="delete the run already in --out and start again")
    sub.add_argument("--allow-config-change", action="store_true",
                     help="let --resume continue with settings that differ from the run's (listed in a warning); "
                          "steps, checkpointing, evaluation cadence, logging and threads may always change")
    add_config_arguments(sub)


@command("train", "train a policy with GRPO (dense or sparse rollouts)", _arguments)
def _train(args) -> int:
    from ..train.trainer import GRPOTrainer

    config = config_from_args(args)
    trainer = GRPOTrainer(config, resume=args.resume, overwrite=args.overwrite,
                          allow_config_change=args.allow_config_change)
    state = trainer.train()
    print(f"done: {state.step} steps in {config.output.out} (metrics.jsonl, tensorboard/, checkpoints/; "
          f"skipped updates: {state.skipped_steps}; steps that rejected most tokens: {state.starving_steps})")
    return 0
