"""A GPT-2 style decoder: pre-norm blocks, causal scaled-dot-product attention, tied embeddings.

Follows karpathy/nanoGPT's model.py. `F.scaled_dot_product_attention` dispatches to flash or
memory-efficient attention kernels on GPUs that have them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..losses import next_token_loss
from .decoding import Decoder, KVCache, attend, positions, project


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = project(self.qkv, x).split(channels, dim=2)
        shape = (batch, seq, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:
            k, v, past = cache.extend(layer, k, v)
        y = attend(q, k, v, past, attn_mask, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(project(self.proj, y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(project(self.proj, F.gelu(project(self.fc, x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(Decoder):
    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
        activation_checkpointing: bool = False,
        loss_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        sizes = dict(vocab_size=vocab_size, block_size=block_size, n_head=n_head, n_embd=n_embd)
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"{name}={size} must be 1 or more")
        if n_layer < 0:
            raise ValueError(f"n_layer={n_layer} must be 0 or more")
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size={loss_chunk_size} must be 1 or more, or null")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.activation_checkpointing = activation_checkpointing
        self.loss_chunk_size = loss_chunk_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default, as in the GPT-2 paper."""
        count = sum(p.numel() for p in self.parameters())
        return count - self.wpe.weight.numel() if non_embedding else count

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token: 6N plus attention (PaLM appendix B)."""
        head_dim = self.n_embd // self.n_head
        return 6 * self.num_params() + 12 * self.n_layer * self.n_head * head_dim * seq_len

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        padding_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab) of `idx` (batch, seq), after the cached positions if any;
        with `targets` (batch, seq), instead, the mean cross-entropy against them (-100: not
        counted), computed here so that a compiled or sharded network covers it too, and
        `loss_chunk_size` positions at a time (models/losses.py) without full logits. A batch of sequences of different lengths comes left-padded, with `padding_mask` (batch,
        cached + seq), True at real tokens: each row's positions count its own tokens and no
        position attends to padding, so a row gets the logits it gets alone."""
        seq = idx.size(1)
        pos, attn_mask = positions(idx, cache, padding_mask, self.block_size)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for layer, block in enumerate(self.blocks):
            if self.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its activations in the backward pass.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, layer, attn_mask)
        if cache is not None:
            cache.advance(seq)
        if targets is not None:
            return next_token_loss(self.ln_f(x), self.lm_head, targets, self.loss_chunk_size)
        return project(self.lm_head, self.ln_f(x))
