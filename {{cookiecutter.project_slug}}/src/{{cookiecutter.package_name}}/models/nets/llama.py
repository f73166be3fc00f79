"""A Llama-family decoder: the architecture of Llama 2 and 3, Mistral, Qwen2/2.5/3 and SmolLM.

Pre-norm blocks with RMSNorm, rotary position embeddings (with Llama 3's frequency scaling),
grouped-query attention (`n_kv_head` key/value heads shared by the `n_head` query heads), a
SwiGLU MLP, and, by family: biases on the query/key/value projections (Qwen2), an RMSNorm of
each head's queries and keys (Qwen3), tied or untied input and output embeddings. Written in
the style of nanoGPT's model.py and LitGPT's; the layer names are those of Hugging Face's
checkpoints (`q_proj`, ..., `down_proj`) so that `model.lora.target_modules` reads as it does for
PEFT, and `checkpointing/hugging_face_decoders.py` maps a checkpoint's names one to one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..losses import next_token_loss
from .decoding import Decoder, KVCache, attend, positions, project

ROPE_TYPES = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square taken in float32 (as Llama's reference code does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The rotation frequency of each pair of a head's dimensions; with `scaling` of type
    `linear` (every frequency divided by `factor`) or `llama3` (Llama 3.1's: low frequencies
    divided by `factor`, high ones kept, a smooth blend between)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling of type {kind!r}: use one of {', '.join(ROPE_TYPES)}")
    if scaling is None or kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rotary(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (…, seq, head_dim) of each position's angles, in float32."""
    angles = pos.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` (batch, heads, seq, head_dim) rotated pairwise: dimension i with i + head_dim/2, as
    Hugging Face's Llama lays the pairs out."""
    half = x.size(-1) // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(
        self,
        n_embd: int,
        n_head: int,
        n_kv_head: int,
        head_dim: int,
        qkv_bias: bool,
        out_bias: bool,
        qk_norm: bool,
        norm_eps: float,
        dropout: float,
    ) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.dropout = dropout
        self.q_proj = nn.Linear(n_embd, n_head * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_head * head_dim, n_embd, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        layer: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = project(self.q_proj, x).view(batch, seq, self.n_head, self.head_dim)
        k = project(self.k_proj, x).view(batch, seq, self.n_kv_head, self.head_dim)
        v = project(self.v_proj, x).view(batch, seq, self.n_kv_head, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if cos.dim() == 3:  # one row of positions for each sequence (left padding)
            cos, sin = cos[:, None], sin[:, None]
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        past = 0
        if cache is not None:
            k, v, past = cache.extend(layer, k, v)
        y = attend(q, k, v, past, attn_mask, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, self.n_head * self.head_dim)
        return project(self.o_proj, y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, n_embd: int, width: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, width, bias=bias)
        self.up_proj = nn.Linear(n_embd, width, bias=bias)
        self.down_proj = nn.Linear(width, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(project(self.gate_proj, x)) * project(self.up_proj, x)
        return project(self.down_proj, hidden)


class Block(nn.Module):
    def __init__(self, n_embd: int, attn: Attention, mlp: MLP, norm_eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(n_embd, norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(n_embd, norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        layer: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, layer, attn_mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(Decoder):
    inv_freq: torch.Tensor

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        n_kv_head: int | None = None,
        head_dim: int | None = None,
        mlp_width: int | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        norm_eps: float = 1e-5,
        qkv_bias: bool = False,
        out_bias: bool = False,
        mlp_bias: bool = False,
        qk_norm: bool = False,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
        activation_checkpointing: bool = False,
        loss_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        head_dim = n_embd // n_head if head_dim is None else head_dim
        mlp_width = 4 * n_embd if mlp_width is None else mlp_width
        sizes = dict(
            vocab_size=vocab_size, block_size=block_size, n_head=n_head, n_embd=n_embd,
            n_kv_head=n_kv_head, head_dim=head_dim, mlp_width=mlp_width,
        )  # fmt: skip
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"{name}={size} must be 1 or more")
        if n_layer < 0:
            raise ValueError(f"n_layer={n_layer} must be 0 or more")
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_head={n_head} must be a multiple of n_kv_head={n_kv_head}")
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim={head_dim} must be even (rotary embeddings turn pairs)")
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size={loss_chunk_size} must be 1 or more, or null")
        self.vocab_size, self.block_size, self.n_layer = vocab_size, block_size, n_layer
        self.n_head, self.n_kv_head, self.n_embd = n_head, n_kv_head, n_embd
        self.head_dim, self.mlp_width = head_dim, mlp_width
        self.gated_mlp = True
        self.activation_checkpointing = activation_checkpointing
        self.loss_chunk_size = loss_chunk_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(
                n_embd,
                Attention(n_embd, n_head, n_kv_head, head_dim, qkv_bias, out_bias, qk_norm,
                          norm_eps, dropout),
                MLP(n_embd, mlp_width, mlp_bias),
                norm_eps,
            )
            for _ in range(n_layer)
        )  # fmt: skip
        self.norm = RMSNorm(n_embd, norm_eps)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.tie_embeddings = tie_embeddings
        self.rope_theta = float(rope_theta)
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        inv_freq = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * max(n_layer, 1)))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; an untied input embedding (a lookup, no product) excluded by
        default."""
        count = sum(p.numel() for p in self.parameters())
        lookup = non_embedding and not self.tie_embeddings
        return count - self.wte.weight.numel() if lookup else count

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token: 6N plus attention (PaLM appendix B)."""
        return 6 * self.num_params() + 12 * self.n_layer * self.n_head * self.head_dim * seq_len

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        padding_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the GPT's forward (gpt.py): logits of `idx` after the cached positions, or with
        `targets` the mean next-token loss; left-padded rows with `padding_mask`."""
        seq = idx.size(1)
        pos, attn_mask = positions(idx, cache, padding_mask, self.block_size)
        rope = rotary(pos, self.inv_freq)
        x = self.drop(self.wte(idx))
        for layer, block in enumerate(self.blocks):
            if self.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its activations in the backward pass.
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope, cache, layer, attn_mask)
        if cache is not None:
            cache.advance(seq)
        if targets is not None:
            return next_token_loss(self.norm(x), self.lm_head, targets, self.loss_chunk_size)
        return project(self.lm_head, self.norm(x))
