"""Supervised warm start of the built-in model on pointer-walk demonstrations.

A curriculum over cycle lengths (short cycles first) is what makes the tiny model learn the
lookup at all; without it, it sits at chance. The last stage is the target distribution itself.
A stage advances when greedy *exact walks* (the response equals the demonstration) on the stage's
own probe set pass its threshold. In the last stage, every probe measures exact walks on held-out
target prompts, and training stops at the first probe inside the band [low, high] at or above
`stop_at`, so that RL has room to improve. The transition is sharp, so if a probe jumps over the
band, training rewinds to the previous probe (weights, optimizer, data stream) and replays those
steps probing after each one. Stopping on exact walks, not on the final answer, is what keeps a
shortcut that lands on the right letter without walking (the first version's failure) from
being shipped. Everything is seeded, so the same seed and thread count reproduce the same weights.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from ..config.schema import WarmupConfig
from ..model.loading import builtin_model_config, count_parameters
from ..tasks.pointer_walk import PointerWalkTask, make_example
from ..tasks.tokenizer import build_char_tokenizer
from ..train.evaluation import greedy_scores


@dataclass
class _Snapshot:
    step: int
    model: dict
    optimizer: dict
    schedule: dict
    rng: object


def warmup(config: WarmupConfig) -> dict:
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
    stages = [tuple(s[:2]) for s in config.curriculum] + [target.letter_range]
    probe_set = target.examples(config.probe_examples, seed=config.seed, split="test")
    stage, best, history, previous = 0, None, [], None
    dense_probing_until = 0  # after a rewind: probe every step up to here
    started = time.perf_counter()
    bar = tqdm(total=config.max_steps, desc="warmup", unit="step")
    step = 0
    while step < config.max_steps:
        step += 1
        bar.update(1)
        low, high = stages[stage]
        model.train()
        loss = _sft_step(model, tokenizer, rng, low, high, config)
        optimizer_step(model, optimizer, schedule, loss)
        final = stage == len(stages) - 1
        every = 1 if step <= dense_probing_until else (config.final_probe_every if final else config.probe_every)
        if step % every:
            continue
        model.eval()
        record = {"step": step, "loss": float(loss), "stage": stage, "letters": [low, high],
                  "seconds": round(time.perf_counter() - started, 1)}
        if not final:
            stage_task = PointerWalkTask(high, min_letters=low)
            scores = greedy_scores(model, tokenizer, stage_task,
                                   stage_task.examples(config.stage_probe_examples, seed=config.seed, split="test"),
                                   stage_task.default_max_new_tokens)
            record["stage_walk_exact"] = scores["walk_exact"]
            history.append(record)
            bar.set_postfix(loss=f"{float(loss):.3f}", stage=f"{low}-{high}", exact=f"{scores['walk_exact']:.2f}")
            if scores["walk_exact"] >= config.curriculum[stage][2]:
                stage += 1
                previous = _snapshot(step, model, optimizer, schedule, rng)
            continue
        scores = greedy_scores(model, tokenizer, target, probe_set, target.default_max_new_tokens)
        record.update(scores)
        history.append(record)
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{scores['accuracy']:.2f}", exact=f"{scores['walk_exact']:.2f}")
        exact = scores["walk_exact"]
        in_band = config.band_low <= exact <= config.band_high and config.band_low <= scores["accuracy"] <= config.band_high
        if in_band and (best is None or abs(exact - config.stop_at) < abs(best[1]["walk_exact"] - config.stop_at)):
            best = (step, dict(scores), copy.deepcopy(model.state_dict()))
        if in_band and exact >= config.stop_at:
            break
        if exact > config.band_high:
            if best is not None:
                break
            if previous is not None and dense_probing_until < step:
                # Jumped over the band between two probes: replay those steps, probing after each.
                dense_probing_until = step
                step = _restore(previous, model, optimizer, schedule, rng)
                bar.n = step
                continue
            break
        previous = _snapshot(step, model, optimizer, schedule, rng)
    bar.close()
    if best is None:
        last = history[-1] if history else {}
        raise RuntimeError(
            f"warm-up never reached held-out exact walks in [{config.band_low}, {config.band_high}] within "
            f"{step} steps (last probe: {json.dumps(last)}); raise --max-steps or lower --final-probe-every")
    step, scores, state = best
    model.load_state_dict(state)
    card = _model_card(model, config, target, step, scores, round(time.perf_counter() - started, 1), history)
    save_model(model, tokenizer, Path(config.out), card)
    return card


def optimizer_step(model, optimizer, schedule, loss: torch.Tensor) -> None:
    """One clipped (norm 1.0) optimizer step on `loss`, then the schedule's; shared by both warm starts."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()


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


def _snapshot(step, model, optimizer, schedule, rng: random.Random) -> _Snapshot:
    return _Snapshot(step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                     copy.deepcopy(schedule.state_dict()), rng.getstate())


def _restore(snapshot: _Snapshot, model, optimizer, schedule, rng: random.Random) -> int:
    model.load_state_dict(snapshot.model)
    optimizer.load_state_dict(snapshot.optimizer)
    schedule.load_state_dict(snapshot.schedule)
    rng.setstate(snapshot.rng)
    return snapshot.step


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


def save_model(model, tokenizer, out: Path, card: dict, files: dict[str, str] | None = None) -> None:
    """save_pretrained (safetensors) plus tokenizer, card and any other `files` (name: text), written to a temp
    dir then renamed."""
    out = out.expanduser()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
