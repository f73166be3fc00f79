"""Will it fit? A training step's memory per device, from the config alone, before a run starts.

The network is built on the meta device (no memory, no weights) to count its parameters. Per
device, a training step holds:
- weights: 4 bytes a parameter (float32 master weights; 2 under bf16-true), and under mixed
  precision a 16-bit copy of each matrix for the forward pass;
- gradients and AdamW's two moments, for the parameters that train (all of them, or LoRA's);
- activations, the tensors autograd saves in the forward pass for the backward pass.
Weights, gradients and optimizer state are divided among the devices under FSDP
(`strategy=fsdp`, `strategy=model_parallel`) and whole on each under DDP.

Activations are counted for decoder-only transformers like the language example's (a network with
`n_layer`, `n_embd`, `n_head` and `block_size`) from what its layers save, per token:
each block keeps its two norms' inputs in float32 (the residual stream) and, in the compute
dtype, the attention's and MLP's inputs, q/k/v, the attention output and the MLP's hidden layers
(14 x n_embd values where the MLP is a GELU four times as wide; a gated MLP, SwiGLU, keeps four
hidden tensors, and grouped-query attention fewer keys and values); the loss keeps a float32 log-softmax over the vocabulary. With activation checkpointing a
block keeps only its input, and one block's activations exist again during its backward pass.
Other networks get no activation figure. CUDA's own workspace and the allocator's fragmentation
come on top: leave a margin of about 10 %.
{%- if cookiecutter.examples != "vision" %}

`model.fp8` is counted as bf16: float8 layers keep some of these tensors in one byte, so for an
FP8 run the figure is an upper bound (`gpt_1b`, batch 16, on an H200: 47.5 GiB estimated, 36.5
measured; 47.6 measured in bf16).
{%- endif %}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..models.lora import add_adapters
from ..targets import build

GIB = 2**30
COMPUTE_BYTES = {"32-true": 4, "64-true": 8, "bf16-true": 2, "16-true": 2}


@dataclass
class MemoryPlan:
    """Bytes per device."""

    weights: int
    gradients: int
    optimizer: int
    activations: int | None
    devices: int
    sharded: bool
    parts: dict[str, int] = field(default_factory=dict)
    upper_bound: bool = False  # FP8 counted as bf16

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + (self.activations or 0)

    def summary(self) -> str:
        spread = (
            f"sharded over {self.devices}" if self.sharded else f"whole on each of {self.devices}"
        )
        activations = (
            f"{self.activations / GIB:.2f}" if self.activations is not None else "not estimated"
        )
        return (
            f"{self.total / GIB:.2f} GiB per device: weights {self.weights / GIB:.2f}, gradients "
            f"{self.gradients / GIB:.2f}, optimizer {self.optimizer / GIB:.2f} ({spread}), "
            f"activations {activations}"
            + ("; model.fp8 counted as bf16, so an upper bound" if self.upper_bound else "")
        )


def shards_itself(model_class: type) -> bool:
    """Whether a LightningModule applies its own parallelism in `configure_model` (Lightning's
    own does nothing), which strategy=model_parallel needs."""
    return any(
        "configure_model" in vars(base)
        for base in model_class.__mro__
        if not base.__module__.startswith("lightning.")
    )


def weight_bytes(precision: str) -> int:
    return 2 if precision in ("bf16-true", "16-true") else 8 if precision == "64-true" else 4


def compute_bytes(precision: str) -> int:
    return COMPUTE_BYTES.get(precision, 2)


def transformer_activation_bytes(net: Any, batch: int, precision: str) -> int:
    """What one training step's forward pass saves, for `batch` windows of `block_size` tokens."""
    tokens = batch * net.block_size
    d, heads, layers = net.n_embd, net.n_head, net.n_layer
    queries = heads * getattr(net, "head_dim", d // heads)
    keys = getattr(net, "n_kv_head", heads) * getattr(net, "head_dim", d // heads)
    width = getattr(net, "mlp_width", 4 * d)
    vocab = net.lm_head.out_features
    a = compute_bytes(precision)
    residual = 4 if a != 2 or precision.endswith("mixed") else 2
    # Attention: its input, q, k, v, its output and the output projection's input; the MLP: its
    # input and hidden layer(s), two for GELU's input and output, four for SwiGLU's gate, up,
    # SiLU(gate) and their product.
    attention = d + 2 * queries + 2 * keys
    mlp = d + (4 if getattr(net, "gated_mlp", False) else 2) * width
    block = (attention + mlp) * a + 2 * d * residual + (4 + heads) * 4
    if getattr(net, "activation_checkpointing", False):
        blocks = layers * d * residual + block  # each block's input, and one block recomputed
    else:
        blocks = layers * block
    head = d * residual + d * a + 4 * vocab + 16  # final LayerNorm, lm_head input, log-softmax, ids
    return tokens * (blocks + head)


def plan_memory(
    model_cfg: DictConfig, batch: int, precision: str, devices: int, strategy_shards: bool
) -> MemoryPlan:
    """The memory of one training step per device, for `devices` devices in all, under a
    strategy that shards (FSDP, FSDP2) or not (`run.plan.Strategy.shards`)."""
    net_cfg = OmegaConf.to_container(model_cfg.net, resolve=True)
    with torch.device("meta"):
        net = build(net_cfg, where="model.net")
        if model_cfg.get("lora"):
            add_adapters(net, **OmegaConf.to_container(model_cfg.lora, resolve=True))  # type: ignore[arg-type]
    params = {id(p): p for p in net.parameters()}.values()
    count = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    adapters = trained if model_cfg.get("lora") else 0
    cast = sum(m.weight.numel() for m in linears) + adapters
    per_weight = weight_bytes(precision)
    weights = count * per_weight
    if precision.endswith("mixed"):
        weights += cast * 2  # the 16-bit copies autocast makes of the matrices it multiplies
    gradients = trained * per_weight
    optimizer = trained * 2 * per_weight
    sharded = strategy_shards and devices > 1
    share = devices if sharded else 1
    activations = None
    if all(hasattr(net, name) for name in ("n_layer", "n_embd", "n_head", "block_size")):
        activations = transformer_activation_bytes(net, batch, precision)
    return MemoryPlan(
        weights // share, gradients // share, optimizer // share, activations, devices, sharded,
        {"parameters": count, "trained": trained}, upper_bound=bool(model_cfg.get("fp8")),
    )  # fmt: skip


def device_memory_gib(accelerator: str) -> float | None:
    if accelerator in ("cuda", "gpu") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return None


def machine_memory_gib() -> float | None:
    """The memory this machine, or the container's limit (cgroup v2) where lower, gives."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX, or the value is unknown
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit():
        memory = min(memory, int(limit))
    return memory / GIB


REMEDIES = (
    "lower data.batch_size (with trainer.accumulate_grad_batches to keep the global batch), set "
    "model.net.activation_checkpointing=true, or use strategy=model_parallel."
)


def fit_warning(plan: MemoryPlan, accelerator: str) -> str | None:
    """A line when the estimate exceeds 90 % of the GPU's memory or, on a CPU, of the machine's
    shared by its training processes (where running out ends the run without a word)."""
    if accelerator == "cpu":
        memory = machine_memory_gib()
        processes = max(1, plan.devices)
        if memory is None or plan.total * processes <= 0.9 * memory * GIB:
            return None
        each = f", {plan.total / GIB:.1f} GiB for each of {processes} processes"
        return (
            f"the estimated {plan.total * processes / GIB:.1f} GiB"
            f"{each if processes > 1 else ''} exceeds 90 % of this "
            f"machine's {memory:.1f} GiB, and the system would kill the run without a message: "
            f"{REMEDIES}"
        )
    memory = device_memory_gib(accelerator)
    if memory is None or plan.total <= 0.9 * memory * GIB:
        return None
    return (
        f"the estimated {plan.total / GIB:.1f} GiB per device exceeds 90 % of this GPU's "
        f"{memory:.1f} GiB: {REMEDIES}"
    )
