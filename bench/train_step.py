"""Time one GRPO training step of ours against TRL's `GRPOTrainer`, same model, task and batch, in one run.

    python bench/train_step.py --steps 3 --threads 2 [--model DIR] [--json FILE] [--profile]
    python bench/train_step.py --shape smollm2 --model models/smollm2-135m --steps 3 --threads 2
    python bench/train_step.py --only trl --trl-rollout both --steps 3 --threads 2    # TRL's generate vs ours

Ours runs twice, with each group's prompt computed once in the learner's forwards (`--share-prompts true`, the
default) and without (`false`), unless `--share-prompts on|off` picks one.

`--trl-rollout ours|both` runs TRL's trainer (also) with `rollout_func=SparseRollouts(dense=True, ignore_eos=True)`
(sparserl.integrations.trl: our engine samples the same batch shape inside TRL's step, dense, no correction),
after the interleaved runs, and prints its step and generation time against TRL's own `model.generate`.

Shapes (`--shape`):
- `builtin` (default): the built-in architecture, random init, pointer-walk prompts (36-56 tokens), 8 prompts x 8
  samples x 256 new tokens;
- `smollm2`: a SmolLM2-135M-Instruct directory (`--model`, from `sparserl model smollm2-135m`; vocabulary
  49,152), 4 prompts x 6 samples x 48 new tokens after prompts of exactly 128 tokens (random lower-case words
  that the tokenizer reads back as the same 128 tokens), rewarded by a cheap function of the completion's text
  that differs between samples (the same function for both trainers), as the README's SmolLM2 config's shape.

Both trainers get the same weights (the built-in architecture, randomly initialised with --seed and
saved to a temp dir, or --model DIR), the same pointer_walk prompts and reward, the same batch
(--prompts x --group samples of exactly --new-tokens tokens), float32, beta=0 (no reference model),
one optimizer step per rollout batch, AdamW at the same lr, grad clip 1.0, no gradient checkpointing,
no logging, eval or checkpoints. Each gets --warmup untimed steps, then --steps timed ones; the table
shows the median (and the min). The two are interleaved: TRL's `trainer.train()` drives the loop and,
after each TRL step (outside TRL's timer), ours runs its step of the same index, so load from other
jobs on a shared machine falls on both alike.

On a shared 2-core machine, other jobs make multi-threaded torch very slow (OpenMP threads wait on
a busy core; a 2-thread step went from 2 s to 80-120 s in one run). The run prints a contention
probe (time of one tiny matmul) and the load average at start and end; if the probe reads in ms
rather than hundredths of a ms, rerun, or use --threads 1.

Forcing every response to --new-tokens tokens (the char tokenizer's EOS is `$`, which a random model
samples now and then):
- ours: the config option `ignore_eos: true`, so the engine never stops early;
- TRL: `generation_kwargs={"min_new_tokens": N}` with `max_completion_length=N`; transformers'
  min-new-tokens processor masks every EOS id TRL passes to `generate` (the tokenizer's `$`) until N
  tokens, so no completion ends or gets masked early. (Setting `eos_token_id` in generation_kwargs
  would not do: TRL masks completions after its own `eos_token_ids`, which always hold the
  tokenizer's EOS.)

What each step contains:
- ours (`sparserl.train.trainer.GRPOTrainer.train_step`): rollout (own KV-cache decode loop) -> decode +
  reward -> recompute (a no-grad forward for pi_old) -> update (forward with grad, backward, clip, AdamW).
- TRL (`trl.GRPOTrainer`, timed from `on_step_begin` to `on_step_end`): `_generate_and_score_completions`
  (`model.generate`, decode, reward, advantages; with num_iterations=1 and steps_per_generation=1 TRL
  skips the old-logprob forward and uses the detached current logprobs), then one forward (fused LM
  head with log-probs + entropy) with grad, backward, clip, AdamW, LR scheduler.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import contention_probe


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("builtin", "smollm2"), default="builtin",
                   help="builtin: 8 x 8 x 256 on the built-in architecture; smollm2: 4 x 6 x 48 after 128-token "
                        "prompts on --model (see above)")
    p.add_argument("--share-prompts", choices=("both", "on", "off"), default="both",
                   help="run ours with shared-prompt forwards, without, or both (default)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per trainer (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per trainer first (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for both (default 2)")
    p.add_argument("--model", default=None, help="an HF model dir (with tokenizer); default: built-in arch, random init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; smollm2: 4)")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8; smollm2: 6)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per response, forced (default 256; smollm2: 48)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="smollm2: tokens per prompt (default 128)")
    p.add_argument("--letters", type=int, default=26, help="pointer_walk difficulty: longest cycle (default 26)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--only", choices=("both", "ours", "trl"), default="both")
    p.add_argument("--trl-rollout", choices=("own", "ours", "both"), default="own",
                   help="TRL samples with its own generate (default), with sparserl's SparseRollouts, or both")
    p.add_argument("--profile", action="store_true", help="cProfile our timed steps and print the top functions")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    defaults = {"builtin": (8, 8, 256), "smollm2": (4, 6, 48)}[args.shape]
    args.prompts, args.group, args.new_tokens = (given if given is not None else default for given, default in
                                                 zip((args.prompts, args.group, args.new_tokens), defaults))
    if args.shape == "smollm2" and not args.model:
        p.error("--shape smollm2 needs --model DIR (sparserl model smollm2-135m --out DIR)")
    return args


# ---------------------------------------------------------------------------------------- task
# The smollm2 shape's reward: a function of the text that differs between samples, cheap to compute.
REWARD_SOURCE = """
def text_reward(completions, **kwargs):
    return [(sum(map(ord, text)) % 7) / 6 for text in completions]
"""


def text_reward(completions, **kwargs):
    return [(sum(map(ord, text)) % 7) / 6 for text in completions]


def fixed_length_prompts(model_dir: Path, count: int, length: int, seed: int) -> list[str]:
    """`count` texts of random lower-case words that the model's tokenizer reads as exactly `length` tokens."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = sorted(w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()
                   and len(w) > 3)
    rng, prompts = random.Random(seed), []
    while len(prompts) < count:
        ids = [tokenizer.convert_tokens_to_ids(rng.choice(words)) for _ in range(length)]
        text = tokenizer.decode(ids)
        if tokenizer(text).input_ids == ids:
            prompts.append(text)
    return prompts


def step_examples(args, model_dir: Path, root: Path) -> tuple[list[dict], dict]:
    """The prompts of every step (distinct per step, the same for both trainers) as dataset rows, and the
    settings that give ours the same task and reward."""
    total = args.prompts * (args.warmup + args.steps)
    if args.shape == "builtin":
        from sparserl.tasks.pointer_walk import PointerWalkTask

        examples = PointerWalkTask(letters=args.letters).examples(total, seed=args.seed, split="train")
        return ([{"prompt": e.prompt, "demonstration": e.demonstration} for e in examples],
                {"task": "pointer_walk", "difficulty": args.letters})
    # Ours draws each step's prompts from the train split of a file (all of one length, so which ones it draws
    # changes no cost): enough of them for that split to hold every step's.
    prompts = fixed_length_prompts(model_dir, 2 * total + 8, args.prompt_tokens, args.seed)
    data, reward = root / "prompts.jsonl", root / "text_reward.py"
    data.write_text("".join(json.dumps({"prompt": p, "label": "0"}) + "\n" for p in prompts))
    prompts = prompts[:total]
    reward.write_text(REWARD_SOURCE)
    # The task's own reward is scored beside (weight 0) for accuracy, as in every run of ours.
    return ([{"prompt": p} for p in prompts],
            {"task": "math_jsonl", "data_path": str(data), "reward_funcs": f"{reward}:text_reward",
             "micro_batch_size": args.prompts * args.group})


# ---------------------------------------------------------------------------------------- model
def prepare_model_dir(args, root: Path) -> Path:
    if args.model:
        return Path(args.model).expanduser()
    from transformers import LlamaForCausalLM

    from sparserl.model.loading import builtin_model_config
    from sparserl.tasks.tokenizer import build_char_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = LlamaForCausalLM(builtin_model_config(len(tokenizer)))
    path = root / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------- ours
class Ours:
    """Our trainer, built once; `step(k)` runs and times `GRPOTrainer.train_step(k)`."""

    def __init__(self, args, model_dir: Path, root: Path, task: dict, share_prompts: bool):
        from sparserl.config.schema import load_config
        from sparserl.train.trainer import GRPOTrainer

        self.args = args
        self.share_prompts = share_prompts
        config = load_config(None, {
            "model": str(model_dir), "dtype": "float32", "threads": args.threads, **task,
            "share_prompts": share_prompts, "max_new_tokens": args.new_tokens,
            "mode": "dense", "prompts_per_step": args.prompts, "group_size": args.group,
            "minibatches": 1, "epochs": 1, "micro_batch_size": args.prompts * args.group,
            "kl_coef": 0.0, "entropy_coef": 0.0, "lr": args.lr, "grad_clip": 1.0, "weight_decay": 0.0,
            "loss_agg": "seq-mean-token-mean", "temperature": 1.0, "seed": args.seed,
            "steps": args.warmup + args.steps, "eval_every": 0, "eval_examples": 1, "log_with": "none",
            "out": str(root / f"ours-share-{share_prompts}"), "ignore_eos": True,
        })
        self.trainer = GRPOTrainer(config)
        self.profiler = cProfile.Profile() if args.profile else None
        self.records: list[dict] = []

    def step(self, step: int) -> None:
        timed = step > self.args.warmup
        torch.set_num_threads(self.args.threads)
        if timed and self.profiler:
            self.profiler.enable()
        started = time.perf_counter()
        metrics = self.trainer.train_step(step)
        wall = time.perf_counter() - started
        if timed and self.profiler:
            self.profiler.disable()
        self.trainer.state.step = step
        if timed:
            self.records.append({"wall_s": wall, **{k: float(metrics[k]) for k in (
                "rollout_s", "recompute_s", "update_s", "step_s", "response_len_mean", "truncated_frac",
                "optimizer_steps", "reward_mean")}})

    def result(self) -> dict:
        self.trainer.close()
        args, records = self.args, self.records
        tokens = args.prompts * args.group * records[0]["response_len_mean"]
        out = summarize(records, "wall_s", tokens)
        mid = median_record(records, "wall_s")  # phases of the median step, so they add up to it
        out["phases"] = {k: mid[k] for k in ("rollout_s", "recompute_s", "update_s")}
        out["phases"]["other_s"] = mid["wall_s"] - sum(out["phases"].values())
        out["response_len_mean"] = records[0]["response_len_mean"]
        out["optimizer_steps"] = records[0]["optimizer_steps"]
        if self.profiler:
            out["profile"] = profile_text(self.profiler, args.profile_top, len(records))
        return out


# ---------------------------------------------------------------------------------------- TRL
def run_trl(args, model_dir: Path, root: Path, rows: list[dict], after_step=None, rollout_func=None) -> dict:
    """TRL's trainer for warmup + steps steps on the dataset `rows`; `after_step(k)` runs after its step k,
    outside the timing; `rollout_func` replaces TRL's generation."""
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )
    from trl import GRPOConfig, GRPOTrainer

    from sparserl.tasks.pointer_walk import PointerWalkTask

    total_steps = args.warmup + args.steps
    # Distinct prompts for every step, like ours (which draws fresh examples per step).
    dataset = Dataset.from_list(rows)

    def pointer_walk_reward(prompts, completions, demonstration, **kwargs):
        return PointerWalkTask(letters=args.letters).reward(completions, demonstration=demonstration)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=str(root / "trl"), use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_steps=total_steps, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="grpo", scale_rewards="group", epsilon=0.2, mask_truncated_completions=False,
        learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=1.0, gradient_checkpointing=False, shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )
    reward = pointer_walk_reward if args.shape == "builtin" else text_reward
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                          train_dataset=dataset, rollout_func=rollout_func)

    steps: list[dict] = []
    current: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            steps.append({**current, "wall_s": time.perf_counter() - current["start"]})
            if after_step is not None:
                after_step(len(steps))
                torch.set_num_threads(args.threads)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            result = fn(*a, **kw)
            current[name] = current.get(name, 0.0) + time.perf_counter() - t
            if name == "generate_and_score_s":
                current["completion_tokens"] = float(result["completion_mask"].sum())
                current["completion_width"] = int(result["completion_ids"].shape[1])
            return result
        return wrapper

    # Phase timers: instance attributes shadow the methods; the step itself is untouched.
    trainer._generate_and_score_completions = timed("generate_and_score_s", trainer._generate_and_score_completions)
    trainer._generate = timed("generate_s", trainer._generate)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm prints a log dict at the end otherwise
    trainer.add_callback(StepTimer())
    torch.set_num_threads(args.threads)
    trainer.train()

    records = steps[args.warmup:]
    if len(records) != args.steps:
        raise RuntimeError(f"TRL ran {len(steps)} steps, expected {total_steps}")
    tokens = records[0]["completion_tokens"]
    out = summarize(records, "wall_s", tokens)
    mid = median_record(records, "wall_s")
    gen, gas = mid["generate_s"], mid["generate_and_score_s"]
    out["phases"] = {"generate_s": gen, "score_s": gas - gen, "update_s": mid["wall_s"] - gas}
    out["response_len_mean"] = tokens / (args.prompts * args.group)
    out["completion_width"] = records[0]["completion_width"]
    return out


# ---------------------------------------------------------------------------------------- report
def med(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def median_record(records: list[dict], key: str) -> dict:
    """The record whose `key` is the (lower) median."""
    ordered = sorted(records, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def summarize(records: list[dict], key: str, tokens: float) -> dict:
    step = med(records, key)
    return {"step_s": step, "min_step_s": min(r[key] for r in records), "steps_s": [r[key] for r in records],
            "tokens_per_step": tokens, "tokens_per_s": tokens / step}


def profile_text(profiler: cProfile.Profile, top: int, steps: int) -> str:
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    buffer.write(f"cProfile over {steps} timed step(s) of ours, by total time in the function itself:\n")
    stats.sort_stats("tottime").print_stats(top)
    buffer.write("by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(top)
    return buffer.getvalue()


OURS = {"ours_shared": "sparserl, shared prompts", "ours_plain": "sparserl, every row's prompt"}
TRLS = {"trl": "TRL GRPOTrainer", "trl_sparserl_rollout": "TRL GRPOTrainer + SparseRollouts(dense)"}


def table(results: dict, args) -> str:
    n = args.prompts * args.group
    prompt = f"{args.prompt_tokens}-token prompts" if args.shape == "smollm2" else "pointer-walk prompts"
    lines = [f"GRPO step, {n} samples ({args.prompts} prompts x {args.group}) x {args.new_tokens} new tokens after "
             f"{prompt}, {args.shape} shape, float32, {args.threads} threads, median of {args.steps} step(s) after "
             f"{args.warmup} warm-up",
             "",
             "| trainer | step s (median) | min | each step s | tokens/step | tokens/s (median) "
             "| phases of the median step (s) |",
             "|---|---|---|---|---|---|---|"]
    for key, name in (*OURS.items(), *TRLS.items()):
        r = results.get(key)
        if r is None:
            continue
        phases = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in r["phases"].items())
        steps = " / ".join(f"{s:.2f}" for s in r["steps_s"])
        lines.append(f"| {name} | {r['step_s']:.2f} | {r['min_step_s']:.2f} | {steps} | {r['tokens_per_step']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | {phases} |")
    trl = results.get("trl")
    lines.append("")
    for key, name in OURS.items():
        ours = results.get(key)
        if ours and trl:
            lines.append(f"{name} / TRL step time: **{ours['step_s'] / trl['step_s']:.2f}x** median, "
                         f"{ours['min_step_s'] / trl['min_step_s']:.2f}x min (rollout / TRL generate: "
                         f"{ours['phases']['rollout_s'] / trl['phases']['generate_s']:.2f}x; recompute+update / TRL "
                         f"update: {(ours['phases']['recompute_s'] + ours['phases']['update_s']) / trl['phases']['update_s']:.2f}x)")
    plugged = results.get("trl_sparserl_rollout")
    if plugged and trl:
        lines.append(f"TRL step with SparseRollouts / with its own generate: **{plugged['step_s'] / trl['step_s']:.2f}x** "
                     f"median, {plugged['min_step_s'] / trl['min_step_s']:.2f}x min (generation phase "
                     f"{plugged['phases']['generate_s'] / trl['phases']['generate_s']:.2f}x)")
    shared, plain = results.get("ours_shared"), results.get("ours_plain")
    if shared and plain:
        learner = lambda r: r["phases"]["recompute_s"] + r["phases"]["update_s"]  # noqa: E731
        lines.append(f"shared / every row's prompt: step **{shared['step_s'] / plain['step_s']:.2f}x**, "
                     f"recompute+update {learner(shared) / learner(plain):.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    results: dict = {"args": vars(args), "load_avg_start": os.getloadavg(),
                     "probe_ms_start": contention_probe(args.threads),
                     "versions": {"torch": torch.__version__}}
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        root = Path(tmp)
        model_dir = prepare_model_dir(args, root)
        rows, task = step_examples(args, model_dir, root)
        variants = {"on": [True], "off": [False], "both": [True, False]}[args.share_prompts]
        ours = {("ours_shared" if share else "ours_plain"): Ours(args, model_dir, root, task, share)
                for share in variants} if args.only in ("both", "ours") else {}

        def ours_step(step: int) -> None:
            for trainer in ours.values():
                trainer.step(step)

        if args.only in ("both", "trl"):
            import transformers
            import trl
            results["versions"].update(trl=trl.__version__, transformers=transformers.__version__)
            # Interleaved: after TRL's step k (outside its timer) ours runs its step k, so background
            # load on a shared machine falls on both alike.
            if args.trl_rollout in ("own", "both"):
                results["trl"] = run_trl(args, model_dir, root, rows, after_step=ours_step if ours else None)
            if args.trl_rollout in ("ours", "both"):
                from sparserl.integrations.trl import SparseRollouts

                results["trl_sparserl_rollout"] = run_trl(
                    args, model_dir, root, rows, after_step=None if "trl" in results or not ours else ours_step,
                    rollout_func=SparseRollouts(dense=True, ignore_eos=True))
        else:
            for step in range(1, args.warmup + args.steps + 1):
                ours_step(step)
        for key, trainer in ours.items():
            results[key] = trainer.result()
    results["probe_ms_end"] = contention_probe(args.threads)
    results["load_avg_end"] = os.getloadavg()
    print(table(results, args))
    print(f"\nload average (1/5/15 min) at start {tuple(round(x, 2) for x in results['load_avg_start'])}, "
          f"at end {tuple(round(x, 2) for x in results['load_avg_end'])}; "
          f"{os.cpu_count()} CPUs; torch threads {args.threads}")
    print(f"contention probe (one [64,128]x[128,384] linear, median ms; hundredths of a ms on free cores, ms when the cores are shared): "
          f"start {results['probe_ms_start']:.3f}, end {results['probe_ms_end']:.3f}")
    for key in OURS:
        if args.profile and key in results:
            print(f"\n{OURS[key]}:\n{results[key]['profile']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
