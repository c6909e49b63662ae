"""Supervised warm start of the built-in model on pointer-walk demonstrations.

A curriculum over the number of letters (short cycles first) is what makes the tiny model learn
the lookup at all; without it, it sits at chance. Training stops at the first probe whose greedy
held-out accuracy at the target difficulty reaches the middle of the band [low, high], so that RL
has room to improve; if a probe jumps past the band, the best in-band probe seen is saved instead.
Everything is seeded, so the same seed and thread count reproduce the same weights.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from .evaluate import greedy_accuracy
from .models import builtin_model_config, count_parameters
from .tasks.pointer_walk import PointerWalkTask, make_example
from .tasks.tokenizer import build_char_tokenizer


@dataclass
class WarmupConfig:
    out: str = "warmup-model"
    seed: int = 0
    letters: int = 12  # the target difficulty whose accuracy must land in the band
    hops: int = 32
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    max_steps: int = 12000
    probe_every: int = 25
    probe_examples: int = 200
    band_low: float = 0.30
    band_high: float = 0.80
    stop_at: float = 0.55
    # (min letters, max letters, accuracy at max letters that moves to the next stage)
    curriculum: list[tuple[int, int, float]] = field(
        default_factory=lambda: [(3, 8, 0.9), (3, 16, 0.9), (8, 26, 0.9), (26, 26, 1.1)])
    threads: int = 1


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
    target = PointerWalkTask(config.letters, config.hops)
    probe_set = target.examples(config.probe_examples, seed=config.seed, split="test")
    stage, best, history = 0, None, []
    started = time.perf_counter()
    bar = tqdm(range(1, config.max_steps + 1), desc="warmup", unit="step")
    for step in bar:
        low, high, _ = config.curriculum[stage]
        model.train()
        loss = _sft_step(model, tokenizer, rng, low, high, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % config.probe_every:
            continue
        model.eval()
        accuracy = greedy_accuracy(model, tokenizer, target, probe_set, target.default_max_new_tokens)
        stage_task = PointerWalkTask(high, config.hops)
        stage_accuracy = greedy_accuracy(model, tokenizer, stage_task,
                                         stage_task.examples(64, seed=config.seed, split="test"),
                                         stage_task.default_max_new_tokens)
        history.append({"step": step, "loss": float(loss), "accuracy": accuracy, "stage": stage,
                        "stage_accuracy": stage_accuracy, "seconds": time.perf_counter() - started})
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{accuracy:.2f}", stage=f"{low}-{high}:{stage_accuracy:.2f}")
        if stage_accuracy >= config.curriculum[stage][2] and stage + 1 < len(config.curriculum):
            stage += 1
        in_band = config.band_low <= accuracy <= config.band_high
        if in_band and (best is None or abs(accuracy - config.stop_at) < abs(best[1] - config.stop_at)):
            best = (step, accuracy, copy.deepcopy(model.state_dict()))
        if (in_band and accuracy >= config.stop_at) or (accuracy > config.band_high and best is not None):
            break
    bar.close()
    if best is None:
        raise RuntimeError(
            f"warm-up never reached held-out accuracy in [{config.band_low}, {config.band_high}] "
            f"within {config.max_steps} steps (last {history[-1]['accuracy']:.2f}); raise --max-steps")
    step, accuracy, state = best
    model.load_state_dict(state)
    card = {
        "model": "pointer-walk Llama", "parameters": count_parameters(model),
        "task": {"name": "pointer_walk", "letters": config.letters, "hops": config.hops},
        "heldout_greedy_accuracy": accuracy, "heldout_examples": config.probe_examples,
        "step": step, "seed": config.seed, "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__, "settings": asdict(config), "probes": history,
    }
    save_model(model, tokenizer, Path(config.out), card)
    return card


def _sft_step(model, tokenizer, rng: random.Random, low: int, high: int, config: WarmupConfig) -> torch.Tensor:
    """Cross-entropy on the response tokens of a fresh batch of demonstrations."""
    rows, targets = [], []
    for _ in range(config.batch_size):
        example = make_example(rng, rng.randint(low, high), config.hops)
        prompt = tokenizer(example.prompt).input_ids
        response = tokenizer(example.demonstration).input_ids
        rows.append(prompt + response)
        targets.append([-100] * len(prompt) + response)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def save_model(model, tokenizer, out: Path, card: dict) -> None:
    """save_pretrained (safetensors) plus tokenizer and card, written to a temp dir then renamed."""
    out = out.expanduser()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
