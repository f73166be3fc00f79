"""The figures of figures.sh's bench.json files (and the doctor's estimates beside them) as
Markdown tables, for docs/benchmarks.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def number(value: object, scale: float = 1.0, places: int = 1, unit: str = "") -> str:
    return "-" if value is None else f"{float(value) * scale:,.{places}f}{unit}"  # type: ignore[arg-type]


def estimate(path: Path) -> str:
    doctor = path.with_name(path.name.replace(".json", ".doctor.json"))
    if not doctor.is_file():
        return "-"
    try:
        memory = str(json.loads(doctor.read_text()).get("memory", "-"))
    except ValueError:  # still being written
        return "-"
    return memory.split(" GiB", 1)[0]


def training_rows(runs: list[tuple[Path, dict]]) -> list[str]:
    rows = [
        "| run | device | FP8 | batch | step ms (Lightning, plain) | ratio | tokens/s | TFLOP/s "
        "| MFU | MFU vs matmul | peak GiB | estimate GiB | float8 layers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, result in runs:
        lightning, plain = result["lightning"], result.get("plain", {})
        rows.append(
            f"| {path.stem} | {result['device']} | {result.get('fp8') or '-'} "
            f"| {result['batch_size']} | {number(lightning['step_time_median_s'], 1e3, 2)}, "
            f"{number(plain.get('step_time_median_s'), 1e3, 2)} | {number(result.get('ratio'), 1, 3)} "
            f"| {number(lightning['tokens_per_sec'], 1, 0)} | {number(lightning['tflops'])} "
            f"| {number(lightning['mfu'], 100, 1, '%')} "
            f"| {number(lightning['mfu_vs_matmul'], 100, 1, '%')} "
            f"| {number(lightning['peak_memory_gib'], 1, 2)} | {estimate(path)} "
            f"| {lightning.get('float8_layers', '-')} |"
        )
    return rows


def peer_rows(runs: list[tuple[Path, dict]]) -> list[str]:
    """Ours (the Lightning loop) against the nanoGPT-style peer of the same run."""
    rows = [
        "| run | device | vocab | batch | loss chunk | step ms (ours, peer) | ours/peer time "
        "| tokens/s (ours, peer) | peak GiB (ours, peer) | ours/peer memory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, result in runs:
        ours, peer, net = result["lightning"], result.get("peer", {}), result.get("net", {})
        rows.append(
            f"| {path.stem} | {result['device']} | {net.get('vocab_size', '-')} "
            f"| {result['batch_size']} | {net.get('loss_chunk_size') or '-'} "
            f"| {number(ours['step_time_median_s'], 1e3, 2)}, "
            f"{number(peer.get('step_time_median_s'), 1e3, 2)} "
            f"| {number(result.get('peer_ratio'), 1, 3)} "
            f"| {number(ours['tokens_per_sec'], 1, 0)}, {number(peer.get('tokens_per_sec'), 1, 0)} "
            f"| {number(ours['peak_memory_gib'], 1, 2)}, {number(peer.get('peak_memory_gib'), 1, 2)} "
            f"| {number(result.get('peer_memory_ratio'), 1, 3)} |"
        )
    return rows


def checkpoint_rows(path: Path, result: dict) -> list[str]:
    rows = [
        "| mode | saves | stall per save (s) | of it waiting (s) | write per save (s) "
        "| fit wall (s) | MB |"
    ]
    rows.append("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, row in result.items():
        if isinstance(row, dict) and "stall_median_s" in row:
            rows.append(
                f"| {mode} | {row['saves']} | {number(row['stall_median_s'], 1, 3)} "
                f"| {number(row.get('wait_median_s'), 1, 3)} "
                f"| {number(row['write_median_s'], 1, 3)} | {number(row['fit_wall_s'])} "
                f"| {number(row['checkpoint_bytes'], 1e-6)} |"
            )
    return rows


def generation_rows(runs: list[tuple[Path, dict]]) -> list[str]:
    """Generation: ours (cached, compiled step) against transformers (dynamic, static cache)."""
    rows = [
        "| run | device | precision | batch | prompt, new | ours cached | ours compiled "
        "| transformers dynamic | transformers static | ours/dynamic | ours/static "
        "| greedy agreement |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, result in runs:
        theirs = result.get("transformers") or {}
        dynamic, static = theirs.get("dynamic", {}), theirs.get("static", {})
        rows.append(
            f"| {path.stem} | {result['device']} | {result['precision']} | {result['batch']} "
            f"| {result['prompt_tokens']}, {result['new_tokens']} "
            f"| {number(result['kv_cache']['tokens_per_sec'])} "
            f"| {number(result.get('compiled', {}).get('tokens_per_sec'))} "
            f"| {number(dynamic.get('tokens_per_sec'))} | {number(static.get('tokens_per_sec'))} "
            f"| {number(dynamic.get('ours_over_transformers'), 1, 2)} "
            f"| {number(static.get('ours_over_transformers'), 1, 2)} "
            f"| {result.get('compiled_greedy_agreement', '-')} |"
        )
    return rows


def main(out: Path) -> None:
    runs, generations = [], []
    for path in sorted(out.glob("*.json")):
        if path.name.endswith(".doctor.json"):
            continue
        result = json.loads(path.read_text())
        if "lightning" in result:
            runs.append((path, result))
        elif "kv_cache" in result:
            generations.append((path, result))
        else:
            print(f"\n{path.stem}: {result.get('command', '')}\n")
            print("\n".join(checkpoint_rows(path, result)))
    if generations:
        print("\n" + "\n".join(generation_rows(generations)))
    if runs:
        print("\n" + "\n".join(training_rows(runs)))
    compared = [(path, result) for path, result in runs if "net" in result]
    if compared:
        print("\n" + "\n".join(peer_rows(compared)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
