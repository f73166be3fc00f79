"""The bench's results: as JSON in `bench.output`, and as a table of the training loops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from ...files import write_text_atomically

# The loops a training bench may time, in the report's column order: the LightningModule's
# `training_step` in Lightning, the same training written out in plain PyTorch, and the peer.
LOOPS = ("lightning", "plain", "peer")


def command_line() -> str:
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:
        overrides = []
    program = "{{ cookiecutter.package_name }}-bench"
    return " ".join([program, *overrides])


def publish(results: dict[str, Any], output: Path, text: str) -> None:
    """Print the report and write the results as JSON."""
    write_text_atomically(json.dumps(results, indent=2) + "\n", output)
    print(text)
    print(f"Wrote {output}")


def rates(
    summary: dict[str, Any],
    samples_per_step: int,
    tokens_per_sample: int | None,
    flops_per_sample: float | None,
    peak: float | None,
    ceiling: float,
) -> dict[str, Any]:
    """Throughput over the whole window (its mean step time), and the achieved share of the
    table's peak and of the measured matmul ceiling."""
    samples_per_sec = samples_per_step / summary["step_time_mean_s"]
    tflops = samples_per_sec * flops_per_sample / 1e12 if flops_per_sample else None
    return {
        "samples_per_sec": samples_per_sec,
        "tokens_per_sec": samples_per_sec * tokens_per_sample if tokens_per_sample else None,
        "tflops": tflops,
        "mfu": tflops / peak if tflops and peak else None,
        "mfu_vs_matmul": tflops / ceiling if tflops else None,
    }


def compare(results: dict[str, Any]) -> None:
    """Lightning's step time over the plain loop's and over the peer's (median and mean), and
    its peak memory over the peer's, for the loops that ran."""
    ours = results["lightning"]
    for other, prefix in (("plain", ""), ("peer", "peer_")):
        if other not in results:
            continue
        theirs = results[other]
        results[f"{prefix}ratio"] = ours["step_time_median_s"] / theirs["step_time_median_s"]
        results[f"{prefix}ratio_mean"] = ours["step_time_mean_s"] / theirs["step_time_mean_s"]
    if "peer" in results:
        mine, theirs = ours.get("peak_memory_gib"), results["peer"].get("peak_memory_gib")
        results["peer_memory_ratio"] = mine / theirs if mine and theirs else None


# The width of the report's row labels, the longest of them
# ("MFU vs matmul (% of 1234.5 TFLOP/s)") included.
LABEL = 36


def report(results: dict[str, Any]) -> str:
    loops = [name for name in LOOPS if name in results]

    def row(label: str, key: str, scale: float = 1.0, places: int = 2) -> str:
        cells = []
        for name in loops:
            value = results[name].get(key)
            cells.append("-" if value is None else f"{value * scale:,.{places}f}")
        return "  " + label.ljust(LABEL) + "".join(f"{cell:>14}" for cell in cells)

    peak = results["peak_tflops"]
    # Both MFU rows are percentages: the loop's TFLOP/s over the GPU's table peak, and over the
    # matmul ceiling measured on this device.
    mfu_vs_table = f"MFU vs table (% of {peak:g} TFLOP/s)" if peak else "MFU vs table peak (%)"
    mfu_vs_matmul = f"MFU vs matmul (% of {results['matmul_tflops']:.1f} TFLOP/s)"
    headers = [results.get("peer_name", name) if name == "peer" else name for name in loops]
    lines = [
        f"{results['command']}",
        f"  {results['device']}, {results['precision']}, "
        f"{'compiled' if results['compile'] else 'eager'}, "
        f"{'FP8 ' + results['fp8'] + ', ' if results['fp8'] else ''}batch {results['batch_size']}, "
        f"{results['steps']} steps after {results['warmup_steps']} warm-up",
        "  " + " " * LABEL + "".join(f"{name:>14}" for name in headers),
        row("step time median (ms)", "step_time_median_s", 1e3),
        row("step time p10 (ms)", "step_time_p10_s", 1e3),
        row("step time p90 (ms)", "step_time_p90_s", 1e3),
        row("step time mean (ms)", "step_time_mean_s", 1e3),
        row("samples/s", "samples_per_sec", places=1),
        row("tokens/s", "tokens_per_sec", places=0),
        row("TFLOP/s", "tflops", places=3),
        row(mfu_vs_table, "mfu", 100, 1),
        row(mfu_vs_matmul, "mfu_vs_matmul", 100, 1),
        row("peak memory (GiB)", "peak_memory_gib"),
        row("data wait share (%)", "data_share", 100, 1),
        row("first step (s)", "first_step_s"),
        row("compile (s)", "compile_s"),
        row("trained parameters", "trained_parameters", places=0),
        row("float8 layers", "float8_layers", places=0),
    ]
    if results.get("matmul_note"):
        lines.append(f"  {results['matmul_note']}")
    if "ratio" in results:
        lines.append(
            f"  Lightning/plain step time: {results['ratio']:.3f} (median), "
            f"{results['ratio_mean']:.3f} (mean); same batches: {results['same_batches']}"
        )
    if "peer_ratio" in results:
        memory = results.get("peer_memory_ratio")
        lines.append(
            f"  Lightning/{results['peer_name']} step time: {results['peer_ratio']:.3f} (median), "
            f"{results['peer_ratio_mean']:.3f} (mean); peak memory: "
            f"{'-' if memory is None else f'{memory:.3f}'}; "
            f"same batches: {results['peer_same_batches']}"
        )
    if results.get("peer_note"):
        lines.append(f"  {results['peer_note']}")
    return "\n".join(lines)
