"""Small pieces every part of the report shares: cells over seeds, markdown tables, settings
looked up in compare.json, a metric's series over steps."""

from __future__ import annotations

from typing import Any

DASH = "—"
DISTILL_SUFFIX = " + DistillSparse"


def series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def fmt(x: float, kind: str) -> str:
    if kind == "pct":
        return f"{100 * x:.1f}"
    if kind == "pts":
        return f"{100 * x:+.1f}"
    if kind == "int":
        return f"{x:.0f}"
    return f"{x:{kind}}"


def cell(values: list[float | None], kind: str = "pct") -> str:
    """Mean over seeds with (min–max) when there are several; "%" appended for percentages."""
    known = [v for v in values if v is not None]
    if not known:
        return DASH
    unit = {"pct": "%", "pts": " pts"}.get(kind, "")
    mean = fmt(sum(known) / len(known), kind) + unit
    if len(known) == 1:
        return mean
    return f"{mean} ({fmt(min(known), kind)}–{fmt(max(known), kind)})"


def markdown(header, rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def setting(config: dict, key: str, default: Any = "?") -> Any:
    # compare.json holds the nested config; field names are unique across sections, so search leaves.
    if key in config and not isinstance(config[key], dict):
        return config[key]
    for value in config.values():
        if isinstance(value, dict):
            found = setting(value, key, None)
            if found is not None:
                return found
    return default


def sparse_sampler(config: dict) -> str:
    """In words, the sparse sampler a run's config names (its rollouts' in a sparse mode, its sparse inference's in
    every mode): what two runs must share for their sparse-inference accuracies to be compared."""
    kind, storage = setting(config, "sparsity", "eviction"), setting(config, "kv_dtype", "auto")
    if kind == "none":
        text = "full cache"
    elif kind == "block":
        text = f"block-sparse attention, {setting(config, 'kv_budget')} tokens"
    else:
        schedule = setting(config, "kv_schedule", None)
        text = f"{setting(config, 'kv_policy')} " + (f"schedule {schedule}" if schedule else
                                                    f"B {setting(config, 'kv_budget')}")
    return text if storage == "auto" else f"{text}, {storage}"
