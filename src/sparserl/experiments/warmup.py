"""Supervised warm start of the built-in model on pointer-walk demonstrations.

A curriculum over cycle lengths (short cycles first) is what makes the tiny model learn the
lookup at all; without it, it sits at chance. The last stage is the target distribution itself.
A stage advances when greedy *exact walks* (the response equals the demonstration) on the stage's
own probe set pass its threshold. In the last stage the warm start's band rule (`supervised.py`, the one
`sparserl sft` runs) probes held-out target prompts and keeps a model inside the band, rewinding when a probe
jumps over it. The task's reward is the exact walk, so stopping on it, not on the final answer, is what keeps a
shortcut that lands on the right letter without walking (the first version's failure) from being shipped.
Everything is seeded, so the same seed and thread count reproduce the same weights.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from ..config.schema import Band, WarmupConfig
from ..model.loading import builtin_model_config, count_parameters
from ..tasks.pointer_walk import PointerWalkTask, make_example
from ..tasks.tokenizer import build_char_tokenizer
from ..train.evaluation import greedy_scores
from ..errors import UserError
from ..train.layout import MODEL_CARD_FILE
from .supervised import check_output_dir, optimizer_step, save_model, warm_start


def warmup(config: WarmupConfig) -> dict:
    check_output_dir(Path(config.out), config.overwrite)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = build_char_tokenizer()
    model = LlamaForCausalLM(builtin_model_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                                  pad_token_id=tokenizer.pad_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98),
                                  weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / config.warmup_steps))
    target = PointerWalkTask(config.letters)
    history: list[dict] = []
    started = time.perf_counter()
    step = _curriculum(model, tokenizer, optimizer, schedule, rng, config, history, started)
    probe_set = target.examples(config.probe_examples, seed=config.seed, split="test")
    low, high = target.letter_range

    def probe(_step: int):
        return greedy_scores(model, tokenizer, target, probe_set, target.default_max_new_tokens), None

    kept = warm_start(model, optimizer, schedule, lambda stream: _sft_step(model, tokenizer, stream, low, high, config),
                      probe, Band(config.band_low, config.band_high, config.stop_at), config.final_probe_every,
                      config.max_steps, rng, history, start_step=step, label="warmup")
    card = _model_card(model, config, target, kept.step, kept.scores, round(time.perf_counter() - started, 1),
                       history)
    save_model(model, tokenizer, Path(config.out), {MODEL_CARD_FILE: json.dumps(card, indent=2) + "\n"})
    return card


def _curriculum(model, tokenizer, optimizer, schedule, rng: random.Random, config: WarmupConfig, history: list[dict],
                started: float) -> int:
    """The early stages, each probed every `probe_every` steps on its own prompts until its exact walks pass its
    threshold; returns the step the last one passed at (the target stage starts after it)."""
    step = 0
    bar = tqdm(total=len(config.curriculum), desc="warmup curriculum", unit="stage")
    for low, high, threshold in config.curriculum:
        stage_task = PointerWalkTask(high, min_letters=low)
        stage_probes = stage_task.examples(config.stage_probe_examples, seed=config.seed, split="test")
        while True:
            if step >= config.max_steps:
                raise UserError(f"warmup: the curriculum stage of {low}-{high} letters never reached {threshold:.0%} "
                                f"exact walks within --max-steps {config.max_steps}")
            step += 1
            model.train()
            loss = _sft_step(model, tokenizer, rng, low, high, config)
            optimizer_step(model, optimizer, schedule, loss)
            if step % config.probe_every:
                continue
            model.eval()
            exact = greedy_scores(model, tokenizer, stage_task, stage_probes,
                                  stage_task.default_max_new_tokens)["walk_exact"]
            history.append({"step": step, "loss": float(loss.detach()), "letters": [low, high], "stage_walk_exact": exact,
                            "seconds": round(time.perf_counter() - started, 1)})
            if exact >= threshold:
                break
        bar.update(1)
    bar.close()
    return step


def _model_card(model, config: WarmupConfig, target: PointerWalkTask, step: int, scores: dict, seconds: float,
                history: list[dict]) -> dict:
    return {
        "model": "pointer-walk Llama", "parameters": count_parameters(model),
        "task": {"name": "pointer_walk", "letters": config.letters, "letter_range": list(target.letter_range)},
        # The task's reward is the exact walk; the final-letter accuracy beside it would show a shortcut.
        "heldout_greedy_accuracy": scores["accuracy"], "heldout_walk_exact": scores["walk_exact"],
        "heldout_answer_accuracy": scores["answer_accuracy"],
        "heldout_first_error_hop": scores.get("first_error_hop"), "heldout_examples": config.probe_examples,
        "step": step, "seed": config.seed, "seconds": seconds,
        "torch": torch.__version__, "settings": asdict(config), "probes": history,
    }


def _sft_step(model, tokenizer, rng: random.Random, low: int, high: int, config: WarmupConfig) -> torch.Tensor:
    """Cross-entropy on the response tokens of a fresh batch of demonstrations."""
    rows, targets = [], []
    for _ in range(config.batch_size):
        example = make_example(rng, rng.randint(low, high))
        prompt = tokenizer(example.prompt).input_ids
        response = tokenizer(example.demonstration).input_ids
        rows.append(prompt + response)
        targets.append([-100] * len(prompt) + response)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


