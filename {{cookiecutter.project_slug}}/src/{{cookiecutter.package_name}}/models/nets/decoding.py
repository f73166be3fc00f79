"""What every decoder-only network of the language example shares: the KV cache, attention over
cached and left-padded positions, and sampling (`Decoder.generate`). A network subclasses
`Decoder` and gives `forward(idx, cache, padding_mask, targets)`, `blocks`, `vocab_size`,
`block_size` and `n_layer`: the GPT (gpt.py) and the Llama-family decoder (llama.py) do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    attn_mask: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention of the new positions' queries `q` (batch, heads, seq, head_dim) over the
    keys and values of every position so far (`past` cached ones first); `k` and `v` may have
    fewer heads (grouped-query attention), each shared by `heads / kv_heads` query heads."""
    seq = q.size(2)
    mask = attn_mask
    if mask is None and past > 0 and seq > 1:
        # New positions see every cached one and, among themselves, those before them.
        mask = torch.ones(seq, past + seq, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=past)
    grouped = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
    # One new position after the cache sees every position: no mask, so SDPA keeps its fastest
    # kernel for the step that generation repeats.
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None and past == 0,
        **grouped,
    )  # fmt: skip


def positions(
    idx: torch.Tensor, cache: KVCache | None, padding_mask: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The positions of `idx`'s tokens (after the cached ones) and, for left-padded rows, the
    attention mask that keeps every position from seeing padding."""
    seq = idx.size(1)
    start = cache.length if cache is not None else 0
    if start + seq > block_size:
        raise ValueError(f"sequence length {start + seq} exceeds block_size {block_size}")
    if padding_mask is None:
        return torch.arange(start, start + seq, device=idx.device), None
    if padding_mask.shape != (idx.size(0), start + seq):
        raise ValueError(
            f"padding_mask has shape {tuple(padding_mask.shape)}; it needs one column "
            f"for each cached and new position: {(idx.size(0), start + seq)}"
        )
    pos = (padding_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, start:]
    return pos, attention_to_real_tokens(padding_mask.bool(), seq)


class Decoder(nn.Module):
    """A decoder-only network over `vocab_size` tokens and a context of `block_size`."""

    vocab_size: int
    block_size: int
    n_layer: int
    blocks: nn.ModuleList

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token at a context of `seq_len`."""
        raise NotImplementedError

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
