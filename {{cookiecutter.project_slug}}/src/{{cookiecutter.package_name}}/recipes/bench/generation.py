"""Generation speed of a language model: new tokens per second with the key/value cache (each
new token runs the network on one position) and without it (each runs on the whole context).
The weights are freshly initialized: speed does not depend on their values."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ...errors import ConfigError
from ...run.machine import configure_matmul_precision, resolve_accelerator, resolve_precision
from ...targets import build
from .training import (
    AUTOCAST_DTYPES,
    TRUE_DTYPES,
    command_line,
    device_name,
    peak_memory_gib,
    publish,
)

log = logging.getLogger(__name__)


def timed_generation(
    net: Any, prompt: torch.Tensor, new_tokens: int, kv_cache: bool, dtype: torch.dtype | None
) -> float:
    """Seconds to generate `new_tokens` after `prompt`, the device synchronized at both ends."""
    device = prompt.device
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        net.generate(prompt, new_tokens, temperature=1.0, top_k=50, kv_cache=kv_cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_generation(cfg: DictConfig) -> dict[str, Any]:
    settings = cfg.bench
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    precision = resolve_precision(str(cfg.trainer.precision), accelerator)
    configure_matmul_precision(cfg.get("matmul_precision"))
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else accelerator)
    model = build(cfg.model, where="model")
    net: Any = getattr(model, "net", None)
    if not callable(getattr(net, "generate", None)):
        raise ConfigError(
            "bench.generation=true needs a language model (a network with a generate method): "
            "choose its experiment, e.g. experiment=<name>."
        )
    net = net.to(device).eval()
    if precision in TRUE_DTYPES:
        net = net.to(TRUE_DTYPES[precision])
    autocast = AUTOCAST_DTYPES.get(precision)
    batch, prompt_tokens = int(settings.batch), int(settings.prompt_tokens)
    new_tokens = int(settings.new_tokens)
    if prompt_tokens + new_tokens > net.block_size:
        raise ConfigError(
            f"bench.prompt_tokens + bench.new_tokens = {prompt_tokens + new_tokens} exceeds the "
            f"model's context ({net.block_size}); the cache would be refilled: lower them."
        )
    generator = torch.Generator().manual_seed(0)
    vocab = net.lm_head.out_features
    prompt = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).to(device)
    results: dict[str, Any] = {
        "command": command_line(), "device": device_name(device),
        "torch_version": torch.__version__, "precision": precision, "batch": batch,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
    }  # fmt: skip
    with torch.inference_mode():
        for name, cached in (("kv_cache", True), ("recompute", False)):
            timed_generation(net, prompt, min(8, new_tokens), cached, autocast)  # warm-up
            seconds = [
                timed_generation(net, prompt, new_tokens, cached, autocast)
                for _ in range(int(settings.repeats))
            ]
            best = min(seconds)
            results[name] = {
                "seconds": best,
                "tokens_per_sec": batch * new_tokens / best,
                "ms_per_token": 1e3 * best / new_tokens,
            }
    results["speedup"] = (
        results["kv_cache"]["tokens_per_sec"] / results["recompute"]["tokens_per_sec"]
    )
    results["peak_memory_gib"] = peak_memory_gib(device)
    publish(results, Path(settings.output), report(results))
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        results["command"],
        f"  {results['device']}, {results['precision']}, batch {results['batch']}, "
        f"{results['new_tokens']} new tokens after a prompt of {results['prompt_tokens']}",
    ]
    for name, label in (("kv_cache", "with the key/value cache"), ("recompute", "recomputing")):
        figures = results[name]
        lines.append(
            f"  {label:<26}{figures['tokens_per_sec']:>12,.1f} tokens/s"
            f"{figures['ms_per_token']:>10.2f} ms/token"
        )
    lines.append(f"  cache speedup: {results['speedup']:.2f}x")
    return "\n".join(lines)
