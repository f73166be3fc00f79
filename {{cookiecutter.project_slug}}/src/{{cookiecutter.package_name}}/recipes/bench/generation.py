"""Generation speed of a language model: new tokens per second with the key/value cache (each
new token runs the network on one position) and without it (each runs on the whole context).
The weights are freshly initialized: speed does not depend on their values.
{%- if cookiecutter.examples != "vision" %}

For this project's GPT, where Hugging Face `transformers` is installed, the same weights also go
into its `GPT2LMHeadModel` (checked to give the same logits), whose `generate` with its cache is
timed in back-to-back pairs with ours (same prompt, top-k sampling, device and precision): the
report gives both rates and the median of the pairs' ratios.
{%- endif %}"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ...errors import ConfigError
from ...run.machine import configure_matmul_precision, resolve_accelerator, resolve_precision
from ...targets import build
from .device import AUTOCAST_DTYPES, TRUE_DTYPES, device_name, peak_memory_gib
from .report import command_line, publish

log = logging.getLogger(__name__)


def timed_generation(
    net: Any, prompt: torch.Tensor, new_tokens: int, kv_cache: bool, dtype: torch.dtype | None,
    compiled: bool = False,
) -> float:  # fmt: skip
    """Seconds to generate `new_tokens` after `prompt`, the device synchronized at both ends."""
    device = prompt.device
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        net.generate(
            prompt, new_tokens, temperature=1.0, top_k=50, kv_cache=kv_cache, compiled=compiled
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


def greedy_agreement(
    net: Any, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype | None
) -> int:
    """How many of the first new tokens the compiled step and the uncompiled one agree on, in
    every row, greedily (all of them, unless rounding in the compiled kernels tips a near-tie)."""
    with torch.autocast(
        prompt.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    ):
        eager = net.generate(prompt, new_tokens, temperature=0.0)
        compiled = net.generate(prompt, new_tokens, temperature=0.0, compiled=True)
    differ = (eager != compiled).any(dim=0)[prompt.size(1) :].nonzero()
    return int(differ[0]) if len(differ) else new_tokens


def hugging_face_twin(net: Any) -> Any | None:
{%- if cookiecutter.examples == "vision" %}
    """None: a project without the language example has no network to compare."""
    return None
{%- else %}
    """Transformers' GPT2LMHeadModel holding `net`'s weights, on its device and in its dtype; None
    where `net` is not this project's GPT or transformers is not installed. Its Conv1D layers
    hold the transposes of our Linear weights; biases we do not have are zeros."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        from ...models.nets.gpt import GPT  # not in a project made without the language example
    except ImportError:
        return None
    if not isinstance(net, GPT):
        return None
    sizes: dict[str, Any] = dict(
        vocab_size=net.vocab_size, n_positions=net.block_size, n_embd=net.n_embd,
        n_layer=net.n_layer, n_head=net.n_head, activation_function="gelu_new",
        layer_norm_epsilon=net.ln_f.eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )  # fmt: skip
    weight = net.wte.weight
    twin: Any = GPT2LMHeadModel(GPT2Config(**sizes))
    twin = twin.to(device=weight.device, dtype=weight.dtype).eval()

    def copy_linear(conv: Any, linear: torch.nn.Linear) -> None:
        conv.weight.copy_(linear.weight.t())
        conv.bias.copy_(linear.bias) if linear.bias is not None else conv.bias.zero_()

    def copy_norm(theirs: Any, ours: torch.nn.LayerNorm) -> None:
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias) if ours.bias is not None else theirs.bias.zero_()

    body = twin.transformer
    with torch.no_grad():
        body.wte.weight.copy_(net.wte.weight)
        body.wpe.weight.copy_(net.wpe.weight)
        blocks: list[Any] = list(net.blocks)
        for ours, theirs in zip(blocks, body.h, strict=True):
            copy_norm(theirs.ln_1, ours.ln_1)
            copy_linear(theirs.attn.c_attn, ours.attn.qkv)
            copy_linear(theirs.attn.c_proj, ours.attn.proj)
            copy_norm(theirs.ln_2, ours.ln_2)
            copy_linear(theirs.mlp.c_fc, ours.mlp.fc)
            copy_linear(theirs.mlp.c_proj, ours.mlp.proj)
        copy_norm(body.ln_f, net.ln_f)
    return twin
{%- endif %}


def timed_hugging_face(
    twin: Any, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype | None, cache: str
) -> float:
    """Seconds for transformers' `generate` to sample `new_tokens` as `timed_generation` does,
    with its `cache`: "dynamic" (its default) or "static" (which it compiles, with CUDA graphs,
    on a GPU)."""
    static = {"cache_implementation": "static"} if cache == "static" else {}
    device = prompt.device
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = twin.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            do_sample=True, top_k=50, temperature=1.0, use_cache=True, pad_token_id=0, **static,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    assert out.size(1) == prompt.size(1) + new_tokens
    return time.perf_counter() - start


def against_hugging_face(
    net: Any, twin: Any, prompt: torch.Tensor, new_tokens: int, repeats: int,
    dtype: torch.dtype | None, compiled: bool,
) -> dict[str, Any]:  # fmt: skip
    """Our cached generation (compiled or not) and transformers' with its dynamic cache and, on a
    GPU, its static compiled one, in `repeats` back-to-back rounds after warm-ups."""
    import transformers

    with torch.autocast(
        prompt.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    ):
        difference = (twin(prompt).logits.float() - net(prompt).float()).abs().max()
    caches = ["dynamic", "static"] if prompt.device.type == "cuda" else ["dynamic"]
    for cache in caches:  # warm-ups: the static cache's length, compilation and CUDA graphs
        for _ in range(1 if cache == "dynamic" else 3):
            timed_hugging_face(twin, prompt, new_tokens, dtype, cache)
    rounds = [
        [timed_generation(net, prompt, new_tokens, True, dtype, compiled)]
        + [timed_hugging_face(twin, prompt, new_tokens, dtype, cache) for cache in caches]
        for _ in range(repeats)
    ]
    results: dict[str, Any] = {
        "version": transformers.__version__,
        "attention": twin.config._attn_implementation,
        "max_logit_difference": float(difference),
        "ours": "compiled" if compiled else "kv_cache",
        "rounds_s": rounds,
    }
    for column, cache in enumerate(caches, start=1):
        best = min(row[column] for row in rounds)
        results[cache] = {
            "seconds": best,
            "tokens_per_sec": prompt.size(0) * new_tokens / best,
            "ms_per_token": 1e3 * best / new_tokens,
            "ours_over_transformers": statistics.median(row[column] / row[0] for row in rounds),
        }
    return results


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
    twin = hugging_face_twin(net)
    setting = settings.get("compile_decode")
    compiled = device.type == "cuda" if setting is None else bool(setting)
    paths = [("kv_cache", True, False), ("recompute", False, False)]
    if compiled:
        paths.insert(1, ("compiled", True, True))
    with torch.inference_mode():
        for name, cached, compiling in paths:
            for _ in range(3 if compiling else 1):  # warm-up: compilation and CUDA graphs
                timed_generation(net, prompt, min(8, new_tokens), cached, autocast, compiling)
            seconds = [
                timed_generation(net, prompt, new_tokens, cached, autocast, compiling)
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
        if compiled:
            results["compiled_speedup"] = (
                results["compiled"]["tokens_per_sec"] / results["kv_cache"]["tokens_per_sec"]
            )
            results["compiled_greedy_agreement"] = greedy_agreement(
                net, prompt, new_tokens, autocast
            )
        results["transformers"] = twin and against_hugging_face(
            net, twin, prompt, new_tokens, int(settings.repeats), autocast, compiled
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
    labels = (("kv_cache", "with the key/value cache"), ("compiled", "cache, compiled step"),
              ("recompute", "recomputing"))  # fmt: skip
    for name, label in labels:
        figures = results.get(name)
        if figures:
            lines.append(
                f"  {label:<30}{figures['tokens_per_sec']:>12,.1f} tokens/s"
                f"{figures['ms_per_token']:>10.2f} ms/token"
            )
    lines.append(f"  cache speedup: {results['speedup']:.2f}x")
    if "compiled_speedup" in results:
        lines.append(
            f"  compiled step over the uncompiled: {results['compiled_speedup']:.2f}x; greedy, "
            f"the same first {results['compiled_greedy_agreement']} of {results['new_tokens']} "
            "tokens"
        )
    theirs = results.get("transformers")
    if theirs:
        ours = "compiled" if theirs["ours"] == "compiled" else "cached"
        for column, cache in enumerate(("dynamic", "static"), start=1):
            if cache not in theirs:
                continue
            figures = theirs[cache]
            label = f"transformers {theirs['version']}, {cache}"
            lines.append(
                f"  {label:<30}{figures['tokens_per_sec']:>12,.1f} tokens/s"
                f"{figures['ms_per_token']:>10.2f} ms/token (generate, {theirs['attention']})"
            )
            ratios = ", ".join(f"{row[column] / row[0]:.2f}" for row in theirs["rounds_s"])
            lines.append(
                f"  ours ({ours}) / transformers ({cache}), tokens/s: "
                f"{figures['ours_over_transformers']:.2f}x (median of {ratios})"
            )
        lines.append(f"  logits differ by at most {theirs['max_logit_difference']:.1e}")
    return "\n".join(lines)
