"""The peer every training bench of a GPT compares against: a nanoGPT-style loop, written out
plainly with its own model (after karpathy/nanoGPT's model.py and train.py), in the same shape
as the measured config.

Its model is nanoGPT's: pre-norm blocks, causal `F.scaled_dot_product_attention`, tied
embeddings, the loss computed in `forward` (so `torch.compile` compiles it with the network).
Its loop is nanoGPT's: autocast in the run's precision, the loss over accumulation, a gradient
scaler for float16, gradient clipping, a fused AdamW on CUDA with weight decay on the matrices
only, the learning rate set by hand each step (warm-up then cosine). It takes the same batches
as the other loops, from the same data module, timed by the same clock.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from ...targets import build
from .clock import StepClock, epochs_of
from .device import AUTOCAST_DTYPES, TRUE_DTYPES

NAME = "nanogpt"
SHAPE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = SelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, bias: bool
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100
        )


def peer_shape(net_cfg: DictConfig) -> dict[str, Any] | None:
    """The peer's sizes from the measured net's config, or None for a net that is no GPT."""
    if not str(net_cfg.get("_target_", "")).endswith(".GPT"):
        return None
    if any(net_cfg.get(key) is None for key in SHAPE):
        return None
    return {key: int(net_cfg[key]) for key in SHAPE} | {"bias": bool(net_cfg.get("bias", False))}


def adamw(model: nn.Module, cfg: DictConfig, device: torch.device) -> torch.optim.AdamW:
    """nanoGPT's `configure_optimizers`: weight decay on the matrices, not on gains and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": float(cfg.get("weight_decay", 0.0))},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    betas = tuple(cfg.get("betas", (0.9, 0.999)))
    return torch.optim.AdamW(groups, lr=float(cfg.lr), betas=betas, fused=fused)


def learning_rate(step: int, top: float, warmup: int, total: int) -> float:
    """nanoGPT's `get_lr`: linear warm-up, then cosine down to a tenth."""
    if step < warmup:
        return top * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return top * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def peer_loop(
    cfg: DictConfig, device: torch.device, precision: str, clock: StepClock, shape: dict[str, Any]
) -> dict[str, Any]:
    seed = int(cfg.get("seed") or 0)
    L.seed_everything(seed, workers=True)
    datamodule = build(cfg.data, where="data")
    datamodule.setup("fit")
    model: nn.Module = NanoGPT(**shape)
    if precision in TRUE_DTYPES:
        model.to(TRUE_DTYPES[precision])
    model.to(device).train()
    optimizer = adamw(model, cfg.model.optimizer, device)
    if cfg.model.get("compile"):
        model = torch.compile(model)  # type: ignore[assignment]
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    scheduler = cfg.model.get("scheduler") or {}
    warmup = int(scheduler.get("warmup_steps") or 0)
    top = float(cfg.model.optimizer.lr)
    total = math.ceil(clock.total / accumulate)
    grad_clip = float(cfg.trainer.get("gradient_clip_val") or 0.0)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    autocast_dtype = AUTOCAST_DTYPES.get(precision)
    stream = epochs_of(datamodule.train_dataloader(), seed)
    for index in range(clock.total):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(stream))
        clock.start((inputs, targets))
        if clock.done:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(index // accumulate, top, warmup, total)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(inputs, targets) / accumulate
        scaler.scale(loss).backward()
        if (index + 1) % accumulate == 0:
            if grad_clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        clock.end()
    return {
        **clock.summary(),
        "trained_parameters": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "float8_layers": 0,
    }
