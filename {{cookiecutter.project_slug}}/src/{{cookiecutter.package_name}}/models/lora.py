"""Low-rank adapters (LoRA, Hu et al. 2021) on a network's Linear layers.

A chosen `nn.Linear` becomes a `LoRALinear`: the same `weight` and `bias` (frozen, under their old
names, so a base checkpoint loads as it is) plus `lora_a` (rank x in) and `lora_b` (out x rank,
zero at the start, so the adapted network starts equal to the base). The output is
`x W^T + b + (alpha / rank) * dropout(x) A^T B^T`. `merge` folds the adapters into `weight` and
turns the layers back into plain `nn.Linear`s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank = rank
        self.scale = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def merged(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear = linear.to(device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            delta = (self.lora_b.float() @ self.lora_a.float()) * self.scale
            linear.weight.copy_(self.weight.float() + delta)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def matches(name: str, targets: Iterable[str]) -> bool:
    """`name` (e.g. blocks.0.attn.qkv) ends with one of the targets, compared part by part."""
    parts = name.split(".")
    for target in targets:
        wanted = target.split(".")
        if parts[-len(wanted) :] == wanted:
            return True
    return False


def add_adapters(
    net: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Iterable[str]
) -> list[str]:
    """Put adapters on the Linear layers whose names match `target_modules` and freeze every other
    parameter; returns the adapted layers' names. Raises ValueError where nothing matches."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.lora.rank={rank!r}: use a whole number of 1 or more.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"model.lora.alpha={alpha!r}: use a positive, finite number (e.g. 16).")
    linears = {name: module for name, module in net.named_modules() if type(module) is nn.Linear}
    chosen = [name for name in linears if matches(name, targets)]
    if not chosen:
        raise ValueError(
            f"model.lora.target_modules={targets} matches none of the network's Linear layers; "
            f"their names end in: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears}))}."
        )
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        setattr(parent, child, LoRALinear(linears[name], rank, alpha, dropout))
    return chosen


def merge(net: nn.Module) -> int:
    """Fold every adapter into its layer's weight, in place; returns how many were merged."""
    adapted = [(n, m) for n, m in net.named_modules() if isinstance(m, LoRALinear)]
    for name, module in adapted:
        parent_name, _, child = name.rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        setattr(parent, child, module.merged())
    for parameter in net.parameters():
        parameter.requires_grad_(True)
    return len(adapted)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
