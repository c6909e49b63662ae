"""`sparserl sft`: a short supervised warm start of any causal LM on a task's demonstrations, stopped where RL
has room to improve.

A real model rarely writes a task's exact answer format unprompted (SmolLM2-135M-Instruct wrote a correct
running total over 8 numbers in 0 of 12 greedy answers): a few supervised steps on the task's demonstrations teach
the format, as the built-in model's warm-up does (`warmup.py`). Each step takes a fresh batch of training
examples, the loss is the cross-entropy of the response tokens (the demonstration, then the tokenizer's EOS, so
that the model learns to stop), AdamW with a linear warm-up. Every `probe_every` steps the greedy accuracy on
held-out examples (the task's own reward) is measured; training stops at the first probe whose accuracy reaches
`stop_at` and is at most `band_high` (a start that RL can still improve), and the model of that probe is saved,
with a card of every probe. A probe past the band is refused: the run says so and saves nothing, so that a model
that learnt the task is never handed to a study as its start.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..config.schema import SFTConfig
from ..errors import UserError
from ..model.forward import response_logprobs
from ..model.loading import load_policy
from ..model.threads import set_threads
from ..tasks.registry import max_new_tokens, task_from_config
from ..train.evaluation import greedy_scores
from .warmup import optimizer_step, save_model

PROBE_SEED_OFFSET = 1_000_003
PROBE_ANSWERS_FILE = "probe_answers.jsonl"  # the saved probe's greedy answers, to read

def sft(config, settings: SFTConfig) -> dict:
    """Warm-start `config.model.model` on `config.task`'s demonstrations; returns the model card."""
    model, tokenizer = load_policy(config.model.model, getattr(torch, config.model.dtype))
    set_threads(config.model.threads, model)
    torch.manual_seed(config.train.seed)
    task = task_from_config(config.task, tokenizer)
    bound = max_new_tokens(config.task, task)
    # Held out, and not the examples a later `sparserl train` evaluates on (its seeds are small numbers): a warm
    # start stopped on a probe of the RL run's own held-out set would start it where that set happens to be easy.
    probes = task.examples(settings.probe_examples, seed=config.train.seed + PROBE_SEED_OFFSET, split="test")
    if any(e.demonstration is None for e in probes):
        raise UserError(f"task {config.task.task} has no demonstrations to learn from; sft needs a task that "
                        "writes its answers (pointer_walk, running_total)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0,
                                  fused=model.device.type in ("cpu", "cuda"))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / settings.warmup_steps))
    rng = random.Random(config.train.seed)
    history, started = [], time.perf_counter()
    answers: list[dict] = []
    probe = _probe(model, tokenizer, task, probes, bound, 0, history, answers)
    for step in tqdm(range(1, settings.steps + 1), desc="sft", unit="step"):
        model.train()
        loss = _loss(model, tokenizer, task.examples(settings.batch_size, seed=rng.randrange(2**31), split="train"))
        optimizer_step(model, optimizer, schedule, loss)
        history.append({"step": step, "loss": float(loss.detach())})
        if step % settings.probe_every == 0:
            answers = []
            probe = _probe(model, tokenizer, task, probes, bound, step, history, answers)
            if probe["accuracy"] > settings.band_high:
                raise UserError(f"sft: held-out greedy accuracy jumped to {probe['accuracy']:.0%} at step {step}, past "
                                f"--band-high {settings.band_high}: probe more often (--probe-every) or lower --lr")
            if probe["accuracy"] >= settings.stop_at:
                break
    else:
        raise UserError(f"sft: held-out greedy accuracy stayed below --stop-at {settings.stop_at} for {settings.steps} "
                        f"steps (last {probe['accuracy']:.0%}); raise --steps or --lr")
    card = {"base_model": config.model.model, "task": config.task.task, "chat_template": config.task.chat_template,
            "step": probe["step"], "heldout_greedy_accuracy": probe["accuracy"],
            "heldout_walk_exact": probe.get("walk_exact"), "heldout_first_error_hop": probe.get("first_error_hop"),
            "heldout_examples": len(probes), "seconds": round(time.perf_counter() - started, 1),
            "settings": asdict(settings), "torch": torch.__version__, "history": history}
    save_model(model, tokenizer, Path(settings.out), card,
               {PROBE_ANSWERS_FILE: "".join(json.dumps(a) + "\n" for a in answers)})
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


def _probe(model, tokenizer, task, examples, bound: int, step: int, history: list[dict], answers: list[dict]) -> dict:
    model.eval()
    scores = greedy_scores(model, tokenizer, task, examples, bound, answers=answers)
    probe = {"step": step, **scores}
    history.append({"probe": probe})
    tqdm.write(f"sft step {step}: held-out greedy accuracy {scores['accuracy']:.1%}"
               + (f", exact walks {scores['walk_exact']:.1%}" if "walk_exact" in scores else ""))
    return probe
