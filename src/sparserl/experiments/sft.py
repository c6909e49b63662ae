"""`sparserl sft`: a short supervised warm start of any causal LM on a task's demonstrations, stopped where RL
has room to improve.

A real model rarely writes a task's exact answer format unprompted (SmolLM2-135M-Instruct wrote a correct
running total over 8 numbers in 0 of 12 greedy answers): a few supervised steps on the task's demonstrations teach
the format, as the built-in model's warm-up does (`warmup.py`), under the same band rule (`supervised.py`). Each
step takes a fresh batch of training examples, the loss is the cross-entropy of the response tokens (the
demonstration, then the tokenizer's EOS, so that the model learns to stop), AdamW with a linear warm-up. Every
`probe_every` steps the greedy accuracy on held-out examples (the task's own reward) is measured; the kept model is
saved on the model's device's weights, with a card of every probe and the kept probe's answers, to read.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..config.schema import Band, SFTConfig
from ..errors import UserError
from ..model.forward import response_logprobs
from ..model.loading import load_policy, resolve_device
from ..model.threads import set_threads
from ..tasks.registry import max_new_tokens, task_from_config
from ..train.evaluation import greedy_scores
from ..train.layout import MODEL_CARD_FILE, PROBE_ANSWERS_FILE
from .supervised import check_output_dir, save_model, warm_start

PROBE_SEED_OFFSET = 1_000_003


def sft(config, settings: SFTConfig) -> dict:
    """Warm-start `config.model.model` on `config.task`'s demonstrations; returns the model card."""
    check_output_dir(Path(settings.out), settings.overwrite)
    model, tokenizer = load_policy(config.model.model, getattr(torch, config.model.dtype),
                                   resolve_device(config.model.device))
    set_threads(config.model.threads, model)
    torch.manual_seed(config.train.seed)
    task = task_from_config(config.task, tokenizer)
    bound = max_new_tokens(config.task, task)
    # Held out, and not the examples a later `sparserl train` evaluates on (its seeds are small numbers): a warm
    # start stopped on a probe of the RL run's own held-out set would start it where that set happens to be easy.
    probes = task.examples(settings.probe_examples, seed=config.train.seed + PROBE_SEED_OFFSET, split="test")
    if any(e.demonstration is None for e in probes):
        raise UserError(f"task {config.task.task} has no demonstrations to learn from; sft needs a task that "
                        "writes its answers (counted_progression, pointer_walk, running_total)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0,
                                  fused=model.device.type in ("cpu", "cuda"))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / settings.warmup_steps))
    started = time.perf_counter()

    def probe(step: int) -> tuple[dict, list[dict]]:
        answers: list[dict] = []
        return greedy_scores(model, tokenizer, task, probes, bound, answers=answers), answers

    model.eval()
    history: list[dict] = [{"step": 0, **probe(0)[0]}]
    kept = warm_start(model, optimizer, schedule,
                      lambda stream: _loss(model, tokenizer, task.examples(settings.batch_size,
                                                                           seed=stream.randrange(2**31), split="train")),
                      probe, Band(settings.band_low, settings.band_high, settings.stop_at), settings.probe_every,
                      settings.steps, random.Random(config.train.seed), history, label="sft")
    card = {"base_model": config.model.model, "task": config.task.task, "chat_template": config.task.chat_template,
            "step": kept.step, "heldout_greedy_accuracy": kept.scores["accuracy"],
            "heldout_walk_exact": kept.scores.get("walk_exact"),
            "heldout_first_error_hop": kept.scores.get("first_error_hop"), "heldout_examples": len(probes),
            "seconds": round(time.perf_counter() - started, 1), "settings": asdict(settings),
            "torch": torch.__version__, "history": history}
    save_model(model, tokenizer, Path(settings.out),
               {MODEL_CARD_FILE: json.dumps(card, indent=2) + "\n",
                PROBE_ANSWERS_FILE: "".join(json.dumps(a) + "\n" for a in kept.extra)})
    return card


def _loss(model, tokenizer, examples) -> torch.Tensor:
    """Mean cross-entropy of the response tokens (the demonstration, then EOS) of `examples`, prompts as context.

    In the engine's layout (left-padded prompts, right-padded responses) through `response_logprobs`, so that the
    LM head runs over response positions only, a chunk at a time: a 49k vocabulary over every prompt position
    was three quarters of a step."""
    prompts = [tokenizer(e.prompt).input_ids for e in examples]
    responses = [tokenizer(e.demonstration, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                 for e in examples]
    width, length, pad = max(map(len, prompts)), max(map(len, responses)), tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p + r + [pad] * (length - len(r))
                        for p, r in zip(prompts, responses)], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(r)) + [0] * (length - len(r))
                         for p, r in zip(prompts, responses)], device=model.device)
    logprobs, _ = response_logprobs(model, ids, mask, width)
    response_mask = mask[:, width:].to(logprobs.dtype)
    return -(logprobs * response_mask).sum() / response_mask.sum()
