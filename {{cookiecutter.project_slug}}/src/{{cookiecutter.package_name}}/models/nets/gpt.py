"""A GPT-2 style decoder: pre-norm blocks, causal scaled-dot-product attention, tied embeddings.

Follows karpathy/nanoGPT's model.py. `F.scaled_dot_product_attention` dispatches to flash or
memory-efficient attention kernels on GPUs that have them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..losses import next_token_loss


class KVCache:
    """The keys and values of every position seen so far, for each block: with it, generating a
    token runs the network on that one position instead of the whole context. Each block's buffers
    take the dtype its keys come in (bf16 under autocast)."""

    def __init__(self, n_layer: int, block_size: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.block_size = block_size
        self.length = 0

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; return those of every position so far."""
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            shape = (k.size(0), k.size(1), self.block_size, k.size(3))
            keys = self.keys[layer] = k.new_zeros(shape)
            values = self.values[layer] = v.new_zeros(shape)
        end = self.length + k.size(2)
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, except for one row on the CPU without gradients (generating one token for one
    sequence): MKL's matrix-vector kernels read a weight stored (in, out) faster than Linear's
    (out, in), so that step uses a transposed copy kept beside the weight (about 20% more tokens/s
    at GPT-2-small size, for once the weights' memory more)."""
    if (
        type(layer) is not nn.Linear
        or torch.compiler.is_compiling()
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or x.numel() != x.size(-1)
    ):
        return layer(x)
    weight = layer.weight
    key = (weight.data_ptr(), weight._version, weight.dtype)
    kept = getattr(layer, "_decode_weight", None)
    if kept is None or kept[0] != key:
        kept = (key, weight.detach().t().contiguous())
        layer._decode_weight = kept  # type: ignore[assignment]
    row = x.reshape(1, -1)
    y = row @ kept[1] if layer.bias is None else torch.addmm(layer.bias, row, kept[1])
    return y.view(*x.shape[:-1], -1)


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
        past = cache.length if cache is not None else 0
        mask = attn_mask
        if mask is None and past > 0 and seq > 1:
            # New positions see every cached one and, among themselves, those before them.
            mask = torch.ones(seq, past + seq, dtype=torch.bool, device=x.device)
            mask = mask.tril(diagonal=past)
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        # One new position after the cache sees every position: no mask, so SDPA keeps its
        # fastest kernel for the step that generation repeats.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and past == 0,
        )  # fmt: skip
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


class GPT(nn.Module):
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
        start = cache.length if cache is not None else 0
        if start + seq > self.block_size:
            raise ValueError(f"sequence length {start + seq} exceeds block_size {self.block_size}")
        attn_mask = None
        if padding_mask is None:
            pos = torch.arange(start, start + seq, device=idx.device)
        else:
            if padding_mask.shape != (idx.size(0), start + seq):
                raise ValueError(
                    f"padding_mask has shape {tuple(padding_mask.shape)}; it needs one column "
                    f"for each cached and new position: {(idx.size(0), start + seq)}"
                )
            pos = (padding_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, start:]
            attn_mask = attention_to_real_tokens(padding_mask.bool(), seq)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for layer, block in enumerate(self.blocks):
            if self.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its activations in the backward pass.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, layer, attn_mask)
        if cache is not None:
            cache.length += seq
        if targets is not None:
            return next_token_loss(self.ln_f(x), self.lm_head, targets, self.loss_chunk_size)
        return project(self.lm_head, self.ln_f(x))

    def new_cache(self) -> KVCache:
        return KVCache(self.n_layer, self.block_size)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        top_k: int | None = None,
        kv_cache: bool = True,
        generator: torch.Generator | None = None,
        on_token: Callable[[torch.Tensor], None] | None = None,
        padding_mask: torch.Tensor | None = None,
        stop_token: int | None = None,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` continuations of `idx` (batch, seq); temperature 0 takes the
        most likely token. The context is the last `block_size` tokens: with the cache, a full
        cache is refilled from that window, so both ways give the same logits.

        Prompts of different lengths come left-padded, with `padding_mask` (batch, seq) True at
        real tokens, and `max_new_tokens` may be one count for each row: each row gets the tokens
        it gets alone. A row ends after its own count or at `stop_token` (which it keeps); the
        loop ends when every row has, and a row's positions after its end hold `stop_token` (0
        without one)."""
        rows = idx.size(0)
        counts = (
            [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
        )
        if len(counts) != rows:
            raise ValueError(f"max_new_tokens has {len(counts)} counts for {rows} rows")
        real = None
        if padding_mask is not None:
            if padding_mask.shape != idx.shape or not bool(padding_mask[:, -1].all()):
                raise ValueError(
                    "padding_mask must have the shape of idx and mark each row's last token real "
                    "(prompts are padded on the left)"
                )
            real = padding_mask.bool()
        # Rows that end apart: each row's end is tracked (one device sync a token).
        tracked = not isinstance(max_new_tokens, int) or stop_token is not None
        limits = torch.tensor(counts, device=idx.device)
        ended = limits <= 0
        filler = 0 if stop_token is None else stop_token
        cache = None
        for step in range(max(counts, default=0)):
            window = None if real is None else real[:, -self.block_size :]
            if not kv_cache:
                logits = self(idx[:, -self.block_size :], padding_mask=window)
            elif cache is None or cache.length >= self.block_size:
                cache = self.new_cache()
                logits = self(idx[:, -self.block_size :], cache, window)
            else:
                window = None if real is None else real[:, -(cache.length + 1) :]
                logits = self(idx[:, -1:], cache, window)
            next_token = sample(logits[:, -1, :], temperature, top_k, generator)
            if tracked:
                next_token = next_token.masked_fill(ended[:, None], filler)
                ended |= limits <= step + 1
                if stop_token is not None:
                    ended |= next_token[:, 0] == stop_token
            idx = torch.cat((idx, next_token), dim=1)
            if real is not None:
                real = torch.cat((real, real.new_ones(rows, 1)), dim=1)
            if on_token is not None:
                on_token(next_token)
            if tracked and bool(ended.all()):
                break
        return idx


def attention_to_real_tokens(real: torch.Tensor, seq: int) -> torch.Tensor:
    """The attention mask (batch, 1, seq, keys) of the last `seq` of `real`'s (batch, keys)
    positions: each sees the real positions up to itself, and itself (a padding position would
    otherwise see nothing, and its NaN reach the others through the keys)."""
    keys = real.size(1)
    past = keys - seq
    causal = torch.ones(seq, keys, dtype=torch.bool, device=real.device).tril(diagonal=past)
    itself = torch.arange(keys, device=real.device) == torch.arange(
        past, keys, device=real.device
    ).unsqueeze(1)
    return ((causal & real[:, None, None, :]) | itself).reshape(real.size(0), 1, seq, keys)


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
