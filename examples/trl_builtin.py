"""TRL's GRPOTrainer with sparse rollouts and a correction, on sparserl's built-in task and model (CPU, minutes).

    python examples/trl_builtin.py [--steps 80] [--correction geo-rs] [--kv-budget 56] [--out runs/trl-builtin]
    sparserl eval --model runs/trl-builtin          # held-out accuracy, as `sparserl train` measures it

The model is the shipped warm-started 0.6M-parameter Llama (`sparserl.model.loading.load_policy(None)`), the task
the pointer walk; the rollouts are R-KV-compressed at `--kv-budget` (56: the built-in experiment's stress regime)
and `--correction` is any sparserl preset. The lines a TRL script adds for sparse rollouts are marked `# sparserl`.
The settings are `sparserl train`'s defaults (configs/stress-regime.yaml at B = 56), so that the two trainers can be
compared step for step. At the end the model is saved to `--out`, where `sparserl eval --model OUT` measures it on
held-out prompts.
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from trl import GRPOConfig

from sparserl.integrations.trl import SparseGRPOTrainer, SparseRollouts  # sparserl
from sparserl.model.loading import load_policy
from sparserl.tasks.pointer_walk import PointerWalkTask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="rollout batches")
    parser.add_argument("--correction", default="geo-rs")
    parser.add_argument("--kv-budget", type=int, default=56)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/trl-builtin")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(1)

    model, tokenizer = load_policy(None)
    task = PointerWalkTask()
    examples = task.examples(8 * args.steps, seed=args.seed, split="train")
    dataset = Dataset.from_list([{"prompt": e.prompt, "demonstration": e.demonstration} for e in examples])

    def walk_reward(completions, demonstration, **kwargs):
        return task.reward(completions, demonstration=demonstration)

    # sparserl train's defaults, in TRL's terms: 8 prompts x 8 a rollout batch, two optimizer steps on it
    # (steps_per_generation=2, so TRL computes pi_old), constant lr 1e-4, k3 KL 1e-4 to the start, clip 1.0.
    config = GRPOConfig(output_dir=args.out, per_device_train_batch_size=32, steps_per_generation=2,
                        num_generations=8, max_completion_length=task.default_max_new_tokens,
                        max_steps=2 * args.steps, learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.0,
                        max_grad_norm=1.0, beta=1e-4, temperature=1.0, loss_type="grpo", use_cpu=True, bf16=False,
                        gradient_checkpointing=False, logging_steps=2, save_strategy="no", report_to="none",
                        seed=args.seed)
    trainer = SparseGRPOTrainer(                                                  # sparserl (was GRPOTrainer)
        model=model, processing_class=tokenizer, reward_funcs=walk_reward, args=config, train_dataset=dataset,
        rollout_func=SparseRollouts(kv_policy="rkv", kv_budget=args.kv_budget),  # sparserl
        correction=args.correction)                                             # sparserl
    trainer.train()
    for record in trainer.state.log_history:
        if "reward" in record:
            print(f"rollout batch {record['step'] // 2}: reward {record['reward']:.3f}, "
                  f"rejected tokens {1 - record.get('sparserl/kept_token_frac', 1.0):.1%}, "
                  f"peak KV {record.get('sparserl/kv_peak_bytes', 0) / 2**20:.2f} MiB")
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
