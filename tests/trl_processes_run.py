"""One optimizer step of `SparseGRPOTrainer`, run by tests/test_trl_processes.py twice: under `accelerate launch
--num_processes 2` (each process holding `--rows` rows of every generation batch) and as one process holding both
processes' rows. Every process saves what it sampled and trained with (`<out>/<sampler>-rank<i>.pt`), and the main
process the logged figures and the weights after the step, for the test to compare.

Two trainers run in turn: R-KV rollouts with α measured, under `sparse-rl` with a KL term (beta > 0, the policy
moved away from the saved reference model), and speculative rollouts. Every prompt is the same, so two rows draw
the same completion exactly when they share a sampling seed. The optimizer is plain SGD without clipping, so the
weights' change is the learning rate times the step's gradient."""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

import sparserl.integrations.trl as integration
from sparserl.integrations.trl import SparseGRPOTrainer, SparseRollouts
from sparserl.rollout.speculative.sampler import SpeculativeSampler
from sparserl.tasks.pointer_walk import PointerWalkTask
from sparserl.tasks.tokenizer import build_char_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
SAMPLERS = {  # name: (the rollout function's settings, the correction, beta)
    "sparse": (dict(kv_budget=10, kv_window=2, kv_interval=2, measure_alpha=True), "sparse-rl", 0.04),
    "speculative": (dict(speculative=True, speculative_draft="window", kv_budget=10), "dense", 0.0),
}
LEARNING_RATE = 0.5


def _distinct_characters(completions, **kwargs):
    """A reward that differs within a group (the random model earns no task reward), so advantages are not 0."""
    return [len(set(text)) % 4 / 3 for text in completions]


def _record(recorded: dict[str, list]) -> None:
    """Wrap, in this process, what the integration calls: the seeds it draws, each local rollout's KV figures, α
    and speculation counts, and each generation batch before (TRL's) and after (ours) the corrections."""
    seeds, schedule, points = integration.generation_seeds, integration.schedule_rollouts, integration.alpha_points
    take_stats, plain = SpeculativeSampler.take_stats, GRPOTrainer._generate_and_score_completions
    corrected = SparseGRPOTrainer._generate_and_score_completions

    def drawn_seeds(trainer, rows):
        recorded["seeds"].append(seeds(trainer, rows))
        return recorded["seeds"][-1]

    def scheduled(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        recorded["kv"].append(dict(peak=batch.kv.kv_peak_bytes, compressions=batch.kv.compressions, rows=len(batch),
                                   kept=batch.kv.kept_tokens.clone(), evicted=batch.kv.evicted_tokens.clone()))
        return batch

    def measured(*args, **kwargs):
        alpha, lengths = points(*args, **kwargs)
        recorded["alpha"].append(alpha.clone())
        return alpha, lengths

    def taken(self):
        counts = take_stats(self)
        recorded["speculation"].append(dict(accepted=counts.accepted, compared=counts.compared, tokens=counts.tokens,
                                            verifications=counts.verifications))
        return counts

    def before(self, inputs):
        out = plain(self, inputs)
        recorded["before"].append({k: out[k].clone() for k in ("advantages", "completion_mask")})
        return out

    def after(self, inputs):
        out = corrected(self, inputs)
        recorded["after"].append({k: out[k].clone() for k in (
            "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_per_token_logps",
            "advantages", "tool_mask")})
        return out

    integration.generation_seeds, integration.schedule_rollouts = drawn_seeds, scheduled
    integration.alpha_points = measured
    SpeculativeSampler.take_stats, GRPOTrainer._generate_and_score_completions = taken, before
    SparseGRPOTrainer._generate_and_score_completions = after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model's directory")
    parser.add_argument("--out", required=True, help="the directory the records go to")
    parser.add_argument("--rows", type=int, required=True, help="rows of each generation batch in each process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    prompt = PointerWalkTask(letters=5).examples(1, seed=0)[0].prompt
    recorded: dict[str, list] = defaultdict(list)
    _record(recorded)
    for name, (settings, correction, beta) in SAMPLERS.items():
        recorded.clear()
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        torch.manual_seed(1)
        with torch.no_grad():  # away from the reference model (TRL loads it from `--model`): a KL term that is not 0
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        config = GRPOConfig(
            output_dir=os.path.join(args.out, name), per_device_train_batch_size=args.rows, num_generations=4,
            gradient_accumulation_steps=2, steps_per_generation=1, max_completion_length=14, max_steps=1,
            optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=0.0, beta=beta,
            shuffle_dataset=False, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
            seed=0, gradient_checkpointing=False)
        dataset = Dataset.from_list([{"prompt": prompt}] * 32)
        trainer = SparseGRPOTrainer(model=model, reward_funcs=_distinct_characters, args=config,
                                    processing_class=tokenizer, train_dataset=dataset,
                                    rollout_func=SparseRollouts(**settings), correction=correction)
        trainer.train()
        rank = trainer.accelerator.process_index
        torch.save(dict(recorded), os.path.join(args.out, f"{name}-rank{rank}.pt"))
        if trainer.accelerator.is_main_process:
            weights = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict()
                       .items()}
            torch.save({"log": trainer.state.log_history, "initial": initial, "weights": weights},
                       os.path.join(args.out, f"{name}-figures.pt"))
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
