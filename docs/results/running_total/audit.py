"""Why sparse rollouts of the running total go wrong: which prompt tokens the failing rows had lost.

    python docs/results/running_total/audit.py --model models/smollm2-running-total [--kv-budget 64]
        [--kv-policy rkv] [--sparsity eviction|block] [--set KEY=VALUE ...] [--n 40] [--threads 1] [--json FILE]

Greedy sparse rollouts on the held-out prompts of `sparserl train --config configs/smollm2-running-total.yaml`
(the same seed-0 test split), the sampler's evictions recorded. Every answer is read line by line against its
prompt's numbers (`check_outputs.check_answer`). Line k of an answer must copy the k-th number from the prompt, so
the token that holds it there is the information the line needs; the audit asks whether the query that wrote the
line's number (or, for a line that ends the answer or runs past the list, the line's first token) could still
see that prompt token, in how many of the model's layers. Each first wrong line is classified:

- `wrong number read`: "t + n = t + n" with n not the k-th number (a copy from the prompt went wrong);
- `wrong sum`: the right number, a wrong total (arithmetic);
- `stopped early`: "The total is ..." before the list ended; `ran past the list`: a line after the last number;
- `other`: anything else (a wrong first line, a malformed line, a wrong final line).

As a baseline it counts how often the needed token was gone where a line copied its number correctly. Output: a
table (Markdown) and, with --json, every first error.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from check_outputs import check_answer, numbers_of

from sparserl.config.schema import load_config
from sparserl.experiments.eval import held_out
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import schedule_rollouts
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.replay import replay_masks
from sparserl.rollout.sparsity.settings import sparsity_from_config
from sparserl.train.evaluation import decode_responses

CONFIG = Path(__file__).parents[3] / "configs/smollm2-running-total.yaml"
ADDITION = re.compile(r"(\d+) \+ (\d+) = (\d+)")


def number_tokens(tokenizer, prompt: str) -> list[int]:
    """The prompt-token index of each listed number's first character."""
    encoded = tokenizer(prompt, return_offsets_mapping=True)
    match = re.search(r"Numbers: (\d+(?:, \d+)*)", prompt)
    starts = [match.start(1) + m.start() for m in re.finditer(r"\d+", match.group(1))]
    offsets = encoded["offset_mapping"]
    return [next(i for i, (a, b) in enumerate(offsets) if a <= start < b) for start in starts]


def response_char_starts(tokenizer, ids: list[int]) -> list[int]:
    """The character offset in the decoded response at which each response token starts."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]


def classify(numbers: list[int], written: list[str], line: int) -> str:
    text = written[line].strip() if line < len(written) else ""
    match = ADDITION.fullmatch(text)
    if line == 0:
        return "other"
    if line < len(numbers):
        if text.startswith("The total is"):
            return "stopped early"
        if match and int(match[2]) != numbers[line]:
            return "wrong number read"
        if match:
            return "wrong sum"
        return "other"
    return "ran past the list" if match else "other"


@torch.no_grad()
def audit(args) -> dict:
    overrides = {"model": args.model, "threads": str(args.threads), "kv_budget": str(args.kv_budget),
                 "kv_policy": args.kv_policy, "sparsity": args.sparsity,
                 **dict(setting.split("=", 1) for setting in args.set)}
    config = load_config(CONFIG, overrides)
    setup = held_out(config, args.n)
    model, tokenizer = setup.model, setup.tokenizer
    compression = sparsity_from_config(config.rollout)
    engine = RolloutEngine(model, compression, record_evictions=True)
    prompts = [tokenizer(e.prompt).input_ids for e in setup.examples]
    sampling = SamplingConfig(max_new_tokens=setup.max_new_tokens, temperature=0.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    batch = schedule_rollouts(engine, prompts, sampling, seeds=[0] * len(prompts))
    texts = decode_responses(tokenizer, batch)
    layers = model.config.num_hidden_layers
    visible = torch.stack(replay_masks(batch.attention_mask, batch.evictions, layers,
                                       blocks=batch.block_selections))  # [layers, N, Hs, S, S]
    width = batch.prompt_ids.shape[1]
    firsts, correct_reads = [], []
    for row, (example, text) in enumerate(zip(setup.examples, texts)):
        numbers = numbers_of(example.prompt)
        prompt_columns = [width - len(prompts[row]) + i for i in number_tokens(tokenizer, example.prompt)]
        end_column = prompt_columns[-1] + 1  # the token after the last number: where the list ends
        response = batch.response_ids[row, :int(batch.response_lengths[row])].tolist()
        starts = response_char_starts(tokenizer, response)
        written = text.split("\n")
        line_starts = [0]
        for line in written[:-1]:
            line_starts.append(line_starts[-1] + len(line) + 1)

        def gone_in_layers(line: int, char: int) -> int | None:
            """Layers in which the query that wrote response character `char` could not see line `line`'s
            needed prompt token (None: no token of the response starts at or after that character)."""
            token = next((i for i, s in enumerate(starts) if s >= char), None)
            if token is None:
                return None
            needed = prompt_columns[line] if line < len(numbers) else end_column
            seen = visible[:, row, :, width + token - 1, needed]  # [layers, Hs]
            return int((~seen.all(dim=1)).sum())

        def number_char(line: int) -> int:
            """Where line `line` writes (or should write) its number: after "t + ", else the line's start."""
            text_of_line = written[line] if line < len(written) else ""
            plus = text_of_line.find(" + ")
            return line_starts[min(line, len(written) - 1)] + (plus + 3 if plus >= 0 else 0)

        right, first_wrong = check_answer(numbers, text)
        for line in range(1, first_wrong if not right else len(numbers)):
            correct_reads.append(gone_in_layers(line, number_char(line)))
        if right:
            continue
        kind = classify(numbers, written, first_wrong)
        firsts.append({"kind": kind, "line": first_wrong, "operands": len(numbers),
                       "needed_gone_layers": gone_in_layers(first_wrong, number_char(first_wrong))
                       if first_wrong > 0 else None})
    return summary(firsts, correct_reads, layers, len(texts), batch, config)


def summary(firsts, correct_reads, layers, n, batch, config) -> dict:
    kinds = defaultdict(list)
    for first in firsts:
        kinds[first["kind"]].append(first)

    def shares(values):
        """(share gone in every layer, share gone in some layer, mean share of layers it was gone in)."""
        known = [v for v in values if v is not None]
        if not known:
            return None, None, None
        return (sum(v == layers for v in known) / len(known), sum(v > 0 for v in known) / len(known),
                statistics.mean(known) / layers)

    table = {}
    for kind, items in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        every, some, mean = shares([i["needed_gone_layers"] for i in items])
        table[kind] = {"count": len(items), "mean_line": statistics.mean(i["line"] for i in items),
                       "needed_gone_all_layers": every, "needed_gone_any_layer": some, "needed_gone_layer_share": mean}
    every, some, mean = shares(correct_reads)
    peak = batch.kv.summary(batch.rollout_seconds)
    return {"examples": n, "right": n - len(firsts), "layers": layers, "kv_budget": config.rollout.kv_budget,
            "kv_policy": config.rollout.kv_policy, "sparsity": config.rollout.sparsity, "kinds": table,
            "correct_reads": len(correct_reads), "correct_reads_gone_all_layers": every,
            "correct_reads_gone_any_layer": some, "correct_reads_gone_layer_share": mean, "kv": peak,
            "first_errors": firsts}


def markdown(result: dict) -> str:
    pct = lambda x: "—" if x is None else f"{x:.0%}"  # noqa: E731
    lines = [f"{result['sparsity']} {result['kv_policy']} B = {result['kv_budget']}: {result['right']} of "
             f"{result['examples']} greedy answers right; KV peak {result['kv'].get('kv_peak_frac', float('nan')):.0%} "
             "of dense",
             "",
             "| first wrong line | count | mean line | needed prompt token gone: in all layers / in any / "
             "mean share of layers |",
             "|---|---|---|---|"]
    for kind, row in result["kinds"].items():
        lines.append(f"| {kind} | {row['count']} | {row['mean_line']:.1f} | {pct(row['needed_gone_all_layers'])} / "
                     f"{pct(row['needed_gone_any_layer'])} / {pct(row['needed_gone_layer_share'])} |")
    lines.append(f"| (baseline) numbers copied right | {result['correct_reads']} | — | "
                 f"{pct(result['correct_reads_gone_all_layers'])} / {pct(result['correct_reads_gone_any_layer'])} / "
                 f"{pct(result['correct_reads_gone_layer_share'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-running-total")
    parser.add_argument("--kv-budget", type=int, default=64)
    parser.add_argument("--kv-policy", default="rkv")
    parser.add_argument("--sparsity", choices=("eviction", "block"), default="eviction")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other config field, e.g. --set kv_sinks=128")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = audit(args)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
