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
    twin: Any, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype | None
) -> float:
    """Seconds for transformers' `generate` to sample `new_tokens` as `timed_generation` does."""
    device = prompt.device
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = twin.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            do_sample=True, top_k=50, temperature=1.0, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    assert out.size(1) == prompt.size(1) + new_tokens
    return time.perf_counter() - start


def against_hugging_face(
    net: Any, twin: Any, prompt: torch.Tensor, new_tokens: int, repeats: int,
    dtype: torch.dtype | None,
) -> dict[str, Any]:  # fmt: skip
    """Our cached generation and transformers', in `repeats` back-to-back pairs."""
    import transformers

    with torch.autocast(
        prompt.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    ):
        difference = (twin(prompt).logits.float() - net(prompt).float()).abs().max()
    timed_hugging_face(twin, prompt, min(8, new_tokens), dtype)  # warm-up
    pairs = [
        (timed_generation(net, prompt, new_tokens, True, dtype),
         timed_hugging_face(twin, prompt, new_tokens, dtype))
        for _ in range(repeats)
    ]  # fmt: skip
    best = min(theirs for _, theirs in pairs)
    return {
        "version": transformers.__version__,
        "attention": twin.config._attn_implementation,
        "max_logit_difference": float(difference),
        "seconds": best,
        "tokens_per_sec": prompt.size(0) * new_tokens / best,
        "ms_per_token": 1e3 * best / new_tokens,
        "pairs_s": [list(pair) for pair in pairs],
        "ours_over_transformers": statistics.median(theirs / ours for ours, theirs in pairs),
    }


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
        results["transformers"] = twin and against_hugging_face(
            net, twin, prompt, new_tokens, int(settings.repeats), autocast
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
    theirs = results.get("transformers")
    if theirs:
        label = f"transformers {theirs['version']}"
        lines.append(
            f"  {label:<26}{theirs['tokens_per_sec']:>12,.1f} tokens/s"
            f"{theirs['ms_per_token']:>10.2f} ms/token (generate, cache, {theirs['attention']})"
        )
        ratios = ", ".join(f"{theirs_s / ours_s:.2f}" for ours_s, theirs_s in theirs["pairs_s"])
        lines.append(
            f"  ours/transformers tokens/s: {theirs['ours_over_transformers']:.2f}x (median of "
            f"{ratios}); logits differ by at most {theirs['max_logit_difference']:.1e}"
        )
    return "\n".join(lines)
