"""The picture of a finished sweep, `summary.png`, drawn with matplotlib (imported only here, when
a sweep ends): one bar per job of the optimized metric, labelled with short parameter names and
values to 3 significant figures, coloured by status, the best job marked."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

STATUS_COLOURS = {
    "COMPLETED": "#4c78a8",
    "PRUNED": "#f2a541",
    "FAILED": "#d62728",
    "CANCELLED": "#8c564b",
}
# Any other status (UNKNOWN, SLURM's TIMEOUT, NODE_FAIL, ...).
OTHER_COLOUR = "#9d9d9d"
MAX_LABEL = 48


def significant(value: Any, figures: int = 3) -> str:
    """A number to `figures` significant figures (0.0012345 -> 0.00123); anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        text = str(value)
        try:
            number = float(text)
        except ValueError:
            return text
        if text.lstrip("-").isdigit():
            return text
        value = number
    if isinstance(value, int):
        return str(value)
    return f"{value:.{figures}g}" if math.isfinite(value) else str(value)


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest suffix that no other key shares (model.optimizer.lr ->
    lr, unless another key also ends in .lr)."""
    short = {}
    for key in keys:
        parts = key.split(".")
        for size in range(1, len(parts) + 1):
            suffix = ".".join(parts[-size:])
            if not any(o != key and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        short[key] = suffix
    return short


def short_labels(overrides: list[str]) -> list[str]:
    """`model.optimizer.lr=0.0012345 seed=2` -> `lr=0.00123 seed=2`, at most MAX_LABEL long."""
    split = [[item.partition("=") for item in text.split()] for text in overrides]
    keys = sorted({key.lstrip("+~") for items in split for key, _, _ in items})
    short = short_keys(keys)
    labels = []
    for items in split:
        label = " ".join(f"{short[k.lstrip('+~')]}={significant(v)}" for k, _, v in items)
        label = label or "(no overrides)"
        labels.append(label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…")
    return labels


def best_job(values: list[float | None], statuses: list[str], mode: str) -> int | None:
    scored = [
        (value, index)
        for index, (value, status) in enumerate(zip(values, statuses, strict=True))
        if status == "COMPLETED" and value is not None and math.isfinite(value)
    ]
    if not scored:
        return None
    return (max(scored) if mode == "max" else min(scored))[1]


def draw_summary(path: Path, rows: list[dict[str, Any]], metric: str, mode: str = "min") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = short_labels([str(row["overrides"]) for row in rows])
    statuses = [str(row["status"]) for row in rows]
    colours = [STATUS_COLOURS.get(status, OTHER_COLOUR) for status in statuses]
    values = [row["metrics"].get(metric) for row in rows]
    values = [float(v) if isinstance(v, (int, float)) else None for v in values]
    best = best_job(values, statuses, mode)
    figure, axes = plt.subplots(figsize=(8, 1.4 + 0.32 * len(rows)), layout="constrained")
    positions = range(len(rows))
    lengths = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
    axes.barh(positions, lengths, color=colours, height=0.7)
    for index, value in enumerate(values):
        text = significant(value) if value is not None else f"no result ({statuses[index].lower()})"
        if index == best:
            text += "  ★ best"
        axes.annotate(
            text, (lengths[index], index), xytext=(4, 0), textcoords="offset points", va="center",
            fontsize=8, fontweight="bold" if index == best else "normal",
            color="black" if value is not None else colours[index],
        )  # fmt: skip
    axes.set_yticks(list(positions), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"{metric} ({'higher' if mode == 'max' else 'lower'} is better)")
    axes.margins(x=0.25)
    axes.set_title(f"{metric} by job", fontsize=10)
    shown = sorted(set(statuses), key=[*STATUS_COLOURS, *statuses].index)
    axes.legend(
        handles=[Patch(color=STATUS_COLOURS.get(s, OTHER_COLOUR), label=s.lower()) for s in shown],
        fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
    )  # fmt: skip
    figure.savefig(path, dpi=110)
    plt.close(figure)
