"""`bench.prepare=true`: the prepare command against a plain `tokenizers` + numpy script
(`plain_prepare.py`, beside this module, which writes the same bytes without this project) on
the same corpus. Both run as fresh processes, as a user runs them: first once each, untimed,
which warms the page cache and checks that they wrote the same tokenizer and shards; then
`bench.repeats` back-to-back pairs, the order alternating, timed by their wall clock. It reports
the median of each, the median of the pairs' ratios (the command over the script) and the
command's first-batch latency (from its start to the first tokens back from its workers)."""

from __future__ import annotations

import filecmp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
from omegaconf import DictConfig

from ...data.shard_format import MANIFEST, read_manifest
from ...data.tokenizing import first_tokens_seconds, importing_this_package
from ...errors import PACKAGE, ConfigError, TrainingError

PLAIN_SCRIPT = Path(__file__).with_name("plain_prepare.py")
OWN_OVERRIDES = ("output", "hydra.", "workers")  # what the bench sets (workers: one per core)


def checked_overrides(settings: DictConfig) -> list[str]:
    overrides = settings.get("prepare_overrides") or []
    if not all(isinstance(override, str) and "=" in override for override in overrides):
        raise ConfigError(
            f"bench.prepare_overrides={list(overrides)}: give a list of the prepare command's "
            "overrides, each quoted: \"bench.prepare_overrides=['max_bytes=null']\"."
        )
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith(OWN_OVERRIDES):
            raise ConfigError(
                f"bench.prepare_overrides holds {override}: the bench sets output, workers (one "
                "per core, as the plain script uses every core) and Hydra's folders itself; "
                "leave it out."
            )
        if key == "tokenizer" and value not in ("bpe", "bytes"):
            raise ConfigError(
                f"bench.prepare_overrides holds {override}: the plain script trains a BPE or "
                "uses bytes; use tokenizer=bpe or tokenizer=bytes."
            )
    return list(overrides)


def prepare_command(overrides: list[str], output: Path) -> list[str]:
    return [
        sys.executable, "-m", f"{PACKAGE}.recipes.prepare", *overrides, f"output={output}",
        f"hydra.run.dir={output.with_name(output.name + '-run')}",
    ]  # fmt: skip


def plain_command(settings: dict[str, Any], output: Path) -> list[str]:
    command = [
        sys.executable, str(PLAIN_SCRIPT), str(settings["source"]), str(output),
        "--tokenizer", str(settings["tokenizer"]), "--vocab-size", str(settings["vocab_size"]),
        "--val-fraction", str(settings["val_fraction"]),
        "--test-fraction", str(settings["test_fraction"]),
        "--shard-tokens", str(settings["shard_tokens"]),
    ]  # fmt: skip
    if settings["max_bytes"] is not None:
        command += ["--max-bytes", str(settings["max_bytes"])]
    return command


def timed(name: str, command: list[str]) -> tuple[float, str]:
    """Wall-clock seconds of `command` and what it printed."""
    start = time.perf_counter()
    finished = subprocess.run(
        command, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        env=importing_this_package(),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if finished.returncode != 0:
        lines = finished.stderr.strip().splitlines() or ["(nothing on stderr)"]
        raise TrainingError(
            f"bench.prepare: the {name} ended with exit code {finished.returncode}: {lines[-1]}"
        )
    return seconds, finished.stdout + finished.stderr


def same_bytes(ours: Path, plain: Path) -> bool:
    """Whether the command wrote the script's files (its manifest aside), byte for byte."""
    written = sorted(path.name for path in plain.iterdir())
    if written != sorted(path.name for path in ours.iterdir() if path.name != MANIFEST):
        return False
    return all(filecmp.cmp(ours / name, plain / name, shallow=False) for name in written)


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.is_file()
        else []
    )
    name = names[0].split(":", 1)[1].strip() if names else platform.processor()
    return f"{name or platform.machine()}, {os.cpu_count()} cores"


def bench_preparation(cfg: DictConfig) -> dict[str, Any]:
    settings = cfg.bench
    overrides = checked_overrides(settings)
    from .report import command_line, publish  # torch, which a refusal above does not wait for

    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        folder = Path(scratch)
        timed("prepare command", prepare_command(overrides, folder / "ours"))
        manifest = read_manifest(folder / "ours", "bench")
        timed("plain script", plain_command(manifest["settings"], folder / "plain"))
        same = same_bytes(folder / "ours", folder / "plain")
        seconds: dict[str, list[float]] = {"prepare": [], "plain": []}
        first_tokens: list[float] = []
        for pair in range(int(settings.repeats)):
            for name in ("prepare", "plain") if pair % 2 == 0 else ("plain", "prepare"):
                output = folder / f"{name}-{pair}"
                if name == "prepare":
                    took, log = timed("prepare command", prepare_command(overrides, output))
                    latency = first_tokens_seconds(log)
                    if latency is not None:
                        first_tokens.append(latency)
                else:
                    took, _ = timed("plain script", plain_command(manifest["settings"], output))
                seconds[name].append(took)
    ratios = [
        ours / plain for ours, plain in zip(seconds["prepare"], seconds["plain"], strict=True)
    ]
    splits = manifest["splits"]
    results: dict[str, Any] = {
        "command": command_line(),
        "device": cpu_name(),
        "python_version": platform.python_version(),
        "tokenizers_version": tokenizers.__version__,
        "prepare_overrides": overrides,
        "settings": manifest["settings"],
        "bytes": sum(split["bytes"] for split in splits.values()),
        "tokens": sum(split["tokens"] for split in splits.values()),
        "same_bytes": same,
        "prepare": {
            "seconds": seconds["prepare"],
            "median_s": statistics.median(seconds["prepare"]),
        },
        "plain": {"seconds": seconds["plain"], "median_s": statistics.median(seconds["plain"])},
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "first_tokens_s": first_tokens,
        "first_tokens_median_s": statistics.median(first_tokens) if first_tokens else None,
    }
    publish(results, Path(settings.output), report(results))
    return results


def report(results: dict[str, Any]) -> str:
    def times(name: str) -> str:
        figures = results[name]
        each = ", ".join(f"{value:.2f}" for value in figures["seconds"])
        return f"{figures['median_s']:>8.2f} s median ({each})"

    latency = results["first_tokens_median_s"]
    return "\n".join(
        [
            results["command"],
            f"  {results['device']}; {results['bytes'] / 1e6:.1f} MB of text -> "
            f"{results['tokens']:,} tokens ({results['settings']['tokenizer']})",
            f"  {'prepare command':<18}{times('prepare')}",
            f"  {'plain script':<18}{times('plain')}",
            f"  command/script: {results['ratio_median']:.2f} (median of "
            + ", ".join(f"{ratio:.2f}" for ratio in results["ratios"])
            + ")",
            "  first tokens back: "
            + ("-" if latency is None else f"{latency:.2f} s after the command started")
            + f"; same bytes: {results['same_bytes']}",
        ]
    )
