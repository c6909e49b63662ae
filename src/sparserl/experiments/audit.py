"""`sparserl audit`: does eviction hurt through the information the walk needs?

Greedy sparse rollouts of the pointer walk on held-out prompts, with the eviction record kept.
For every wrong rollout it finds the first character that differs from the demonstration, its
role (counter, key, value, end marker, answer), the token whose information it needed (the
prompt link for a value, the previous value for a key, the prompt's last counter for the end
marker), whether that token had been evicted from the cache the query saw (in how many of the
full-attention layers), ξ = π_dense / π_sparse of the token written there, and whether the dense
model, given the same prefix, would have written the right one. As a baseline it reports how
often the needed token was evicted where the sparse sampler wrote a value *correctly*.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.structure import positions_from_mask
from ..rollout.batch import KVStats, SamplingConfig
from ..rollout.dispatch.scheduler import schedule_rollouts
from ..rollout.engine.engine import RolloutEngine
from ..rollout.sparsity.replay import replay_masks
from ..rollout.sparsity.settings import budgeted_sparsity
from ..tasks.pointer_walk import first_error_hop, needed_source
from ..train.evaluation import decode_responses
from .eval import held_out


def _column(source: str, index: int, prompt_width: int, prompt_length: int) -> int:
    """The engine's column (left-padded prompt, then response) of a prompt or response character."""
    return prompt_width - prompt_length + index if source == "prompt" else prompt_width + index


@torch.no_grad()
def run_audit(config, n: int, batch_size: int = 100) -> dict:
    if config.task.task != "pointer_walk":
        raise ConfigError("sparserl audit reads the pointer walk's structure; use --task pointer_walk")
    compression = budgeted_sparsity(config.rollout, "sparserl audit")  # before any model loads
    setup = held_out(config, n)
    model, tokenizer, examples = setup.model, setup.tokenizer, setup.examples
    # The sparse sampler as training runs it: its KV policy and its KV storage (a quantized cache, `kv_dtype`).
    engine = RolloutEngine(model, compression, record_evictions=True, kv_dtype=config.rollout.kv_dtype)
    limits = setup.limits.for_inference()
    sampling = SamplingConfig(max_new_tokens=setup.max_new_tokens, temperature=0.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              **limits.sampling_fields())
    layers = model.config.num_hidden_layers
    firsts, correct_values, batches = [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = schedule_rollouts(engine, [tokenizer(e.prompt).input_ids for e in chunk], sampling,
                                  seeds=[0] * len(chunk))  # greedy: the seeds draw nothing
        batches.append(batch)
        texts = decode_responses(tokenizer, batch)
        ids, mask = batch.input_ids, batch.attention_mask
        dense_logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                                             use_cache=False).logits.float(), dim=-1)
        # What each query saw: after evictions, or (block-sparse) the pages it attended.
        visible = torch.stack(replay_masks(mask, batch.evictions, layers,
                                           blocks=batch.block_selections))  # [layers, N, Hs, S, S]
        width = batch.prompt_ids.shape[1]
        for row, (example, text) in enumerate(zip(chunk, texts)):
            prompt_length = len(example.prompt)

            def evicted_layers(char_index: int) -> int | None:
                role, source, index = needed_source(example.prompt, example.demonstration, char_index)
                if source is None:
                    return None
                query = width + char_index - 1  # the query that produced response character `char_index`
                needed = _column(source, index, width, prompt_length)
                if needed > query:
                    return None  # the information was never written (a deviation came before it)
                seen = visible[:, row, :, query, needed]  # [layers, Hs]
                return int((~seen.all(dim=1)).sum())

            hop = first_error_hop(text, example.demonstration)
            demo = example.demonstration.rstrip("$")
            limit = len(demo) if hop is None else next(
                (i for i, (a, b) in enumerate(zip(text, demo)) if a != b), min(len(text), len(demo)))
            for i in range(limit):  # the values the sparse sampler wrote correctly
                if needed_source(example.prompt, example.demonstration, i)[0] == "value":
                    correct_values.append(evicted_layers(i))
            if hop is None:
                continue
            role = needed_source(example.prompt, example.demonstration, limit)[0]
            column = width + limit
            written = limit < batch.response_lengths[row]
            xi = None
            if written:
                token = ids[row, column]
                xi = float(torch.exp(dense_logp[row, column - 1, token] - batch.sampler_logprobs[row, limit]))
            target = tokenizer(demo[limit] if limit < len(demo) else "$").input_ids[0]
            firsts.append({"role": role, "char": limit, "hop": hop, "evicted_layers": evicted_layers(limit),
                           "xi": xi, "dense_argmax_right": int(dense_logp[row, column - 1].argmax()) == target,
                           "letters": example.extra["letters"], "hops": example.extra["hops"]})
    kv = KVStats.merged([b.kv for b in batches], [len(b) for b in batches])
    return {**_summary(firsts, correct_values, layers, len(examples), dataclasses.asdict(compression)),
            "kv": {"kv_dtype": kv.kv_dtype, **kv.summary(sum(b.rollout_seconds for b in batches))}}


def _summary(firsts: list[dict], correct_values: list[int | None], layers: int, n: int, compression: dict) -> dict:
    by_role = defaultdict(list)
    for f in firsts:
        by_role[f["role"]].append(f)
    roles = {role: _role_summary(items, layers) for role, items in sorted(by_role.items(), key=lambda kv: -len(kv[1]))}
    baseline = [k for k in correct_values if k is not None]
    return {"examples": n, "wrong": len(firsts), "layers": layers, "compression": compression, "by_role": roles,
            "correct_values": len(baseline),
            "correct_values_needed_evicted_any_layer": _share(baseline, lambda k: k > 0),
            "correct_values_needed_evicted_all_layers": _share(baseline, lambda k: k == layers),
            "first_errors": firsts}


def _role_summary(items: list[dict], layers: int) -> dict:
    """What the first deviations of one role have in common: the needed token's eviction, ξ, the dense model."""
    known = [f["evicted_layers"] for f in items if f["evicted_layers"] is not None]
    xis = [f["xi"] for f in items if f["xi"] is not None]
    return {"count": len(items),
            "needed_evicted_all_layers": _share(known, lambda k: k == layers),
            "needed_evicted_any_layer": _share(known, lambda k: k > 0),
            "xi_median": statistics.median(xis) if xis else None,
            "xi_below_1e-4": _share(xis, lambda x: x < 1e-4),
            "dense_argmax_right": sum(f["dense_argmax_right"] for f in items) / len(items),
            "mean_hop": sum(f["hop"] for f in items) / len(items)}


def _share(values: list, holds) -> float | None:
    """The fraction of `values` for which `holds` is true; None when there are none."""
    return sum(holds(v) for v in values) / len(values) if values else None


def audit_table(result: dict) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.0f}%"

    lines = ["| first deviation | count | mean hop | needed token evicted (all layers / any) | ξ median | ξ < 1e-4 "
             "| dense model right there |", "|---|---|---|---|---|---|---|"]
    for role, r in result["by_role"].items():
        xi = "—" if r["xi_median"] is None else f"{r['xi_median']:.2g}"
        lines.append(f"| {role} | {r['count']} | {r['mean_hop']:.1f} | {pct(r['needed_evicted_all_layers'])} / "
                     f"{pct(r['needed_evicted_any_layer'])} | {xi} | {pct(r['xi_below_1e-4'])} "
                     f"| {pct(r['dense_argmax_right'])} |")
    c = result["compression"]
    settings = f"{c['policy']}, budget {c['budget']}, window {c['window']}, interval {c['interval']}" if "policy" in c \
        else f"block-sparse attention, budget {c['budget']} in pages of {c['page_size']}, {c['dense_layers']} dense layers"
    return (f"{result['wrong']} of {result['examples']} greedy sparse rollouts deviate from the demonstration "
            f"({settings}; "
            f"{result['layers']} layers; peak KV {result['kv']['kv_peak_bytes'] / 2**20:.2f} MiB with "
            f"{result['kv']['rows_in_flight']} rows at once; KV saved against dense: `sparserl eval --inference "
            "both`).\n\n"
            + "\n".join(lines) +
            f"\n\nBaseline: where the sparse sampler wrote a value correctly ({result['correct_values']} values), "
            f"the link it needed had been evicted in all layers {pct(result['correct_values_needed_evicted_all_layers'])} "
            f"of the time, in some layer {pct(result['correct_values_needed_evicted_any_layer'])}.")


def write_audit(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(audit_table(result) + "\n")
