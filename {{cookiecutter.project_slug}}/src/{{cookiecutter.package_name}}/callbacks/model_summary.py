"""Lightning's model summary, without a FLOPs column that counted nothing."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

# Lightning's own logger for the summary: the table goes where it always went.
log = logging.getLogger("lightning.pytorch.callbacks.model_summary")

FLOPS_COLUMN = "FLOPs"
TOTAL_FLOPS_LINE = "Total Flops"
# A layer's FLOPs cell where nothing was counted (n/a: the parameters of no layer).
NOTHING_COUNTED = ("0", "n/a")


class ModelSummary(LightningModelSummary):
    """Lightning's ModelSummary, less its FLOPs column and "Total Flops" line where they counted
    nothing. Lightning counts FLOPs only in a forward pass of the model's `example_input_array`;
    without one (the models here set none) every layer would read 0. A model that sets one keeps
    the column and the total."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], *args: Any, **kwargs: Any) -> None:
        flops = dict(summary_data).get(FLOPS_COLUMN)
        total_flops = kwargs.get("total_flops", 0)
        counted = total_flops or any(cell.strip() not in NOTHING_COUNTED for cell in flops or [])
        if flops is None or counted:  # a Lightning that counts no FLOPs (before 2.5), or counted
            LightningModelSummary.summarize(summary_data, *args, **kwargs)
            return
        kept = [(name, cells) for name, cells in summary_data if name != FLOPS_COLUMN]
        # Lightning 2.5 on: (total, trainable, size (MB), modules by mode, total FLOPs, *columns).
        table = _format_summary_table(*args, total_flops, *kept)
        head, _, last = table.rpartition("\n")
        log.info("\n" + (head if last.endswith(TOTAL_FLOPS_LINE) else table))
