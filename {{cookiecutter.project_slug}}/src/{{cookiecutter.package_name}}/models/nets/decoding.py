"""What every decoder-only network of the language example shares: the KV cache, attention over
cached and left-padded positions, and sampling (`Decoder.generate`). A network subclasses
`Decoder` and gives `forward(idx, cache, padding_mask, targets)`, `blocks`, `vocab_size`,
`block_size` and `n_layer`: the GPT (gpt.py) and the Llama-family decoder (llama.py) do."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """The keys and values of every position seen so far, for each block: with it, generating a
    token runs the network on that one position instead of the whole context. Each block's buffers
    take the dtype its keys come in (bf16 under autocast) and hold `block_size` positions: the
    network's context, or fewer for a generation known to need fewer.

    A compiled decode step (`Decoder.generate(compiled=True)`) needs shapes that do not change
    from one token to the next: between its steps the cache is `stepping`, and each step writes
    its one position at `write_at` (a tensor) and attends over the whole buffer, with `step_mask`
    hiding the positions not written yet and `step_positions` giving each row's position. Rows
    of their own lengths (continuous batching, `prepare_rows`) write each at its own column."""

    def __init__(self, n_layer: int, block_size: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.block_size = block_size
        self.length = 0
        self.stepping = False
        self.write_at = torch.zeros(1, dtype=torch.long)
        self.step_positions = torch.zeros(1, 1, dtype=torch.long)
        self.step_mask = torch.zeros(1, 1, 1, block_size, dtype=torch.bool)

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store the new positions' keys and values; return those of every position so far and
        how many came before the new ones (stepping: the whole buffer, and 0: `step_mask`
        says what each position sees)."""
        keys, values = self.keys[layer], self.values[layer]
        shape = (k.size(0), k.size(1), self.block_size, k.size(3))
        if (
            keys is None
            or values is None
            or keys.shape != shape
            or (keys.dtype, keys.device) != (k.dtype, k.device)
        ):
            keys, values = self.new_buffers(layer, shape, k)
        if self.stepping:
            if self.write_at.numel() == 1:  # every row at one column
                keys.index_copy_(2, self.write_at, k)
                values.index_copy_(2, self.write_at, v)
            else:  # each row at its own
                rows = torch.arange(k.size(0), device=k.device)
                keys[rows, :, self.write_at] = k[:, :, 0]
                values[rows, :, self.write_at] = v[:, :, 0]
            return keys, values, 0
        past = self.length
        end = past + k.size(2)
        if end > self.block_size:
            raise ValueError(f"{end} positions exceed the cache's {self.block_size}")
        keys[:, :, past:end] = k
        values[:, :, past:end] = v
        return keys[:, :, :end], values[:, :, :end], past

    def new_buffers(
        self, layer: int, shape: tuple[int, ...], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys[layer] = like.new_zeros(shape)
        values = self.values[layer] = like.new_zeros(shape)
        # Compiled steps write into these buffers in place, at the same addresses each time
        # (what CUDA graphs replay).
        torch._dynamo.mark_static_address(keys)
        torch._dynamo.mark_static_address(values)
        return keys, values

    def advance(self, seq: int) -> None:
        """After the network ran on `seq` new positions (a compiled step's caller advances)."""
        if not self.stepping:
            self.length += seq

    def restart(self) -> None:
        """Empty again, its buffers kept (zeroed: what a step masks out must still be finite)."""
        for buffer in (*self.keys, *self.values):
            if buffer is not None:
                buffer.zero_()
        self.length = 0
        self.stepping = False

    def prepare_step(self, real: torch.Tensor | None, rows: int) -> None:
        """Inputs of the next compiled step, which writes position `length`: `real` (rows,
        length + 1) marks each row's real tokens (left padding), None when every row has them."""
        device = self.keys[0].device if self.keys and self.keys[0] is not None else None
        columns = torch.arange(self.block_size, device=device)
        self.write_at = torch.full((1,), self.length, dtype=torch.long, device=device)
        if real is None:
            self.step_positions = self.write_at.expand(rows, 1).contiguous()
            visible = (columns <= self.length).expand(rows, -1).contiguous()
        else:
            counted = real.long().sum(dim=1, keepdim=True)
            self.step_positions = (counted - 1).clamp(min=0)
            visible = torch.zeros(rows, self.block_size, dtype=torch.bool, device=device)
            visible[:, : real.size(1)] = real
        self.step_mask = visible.reshape(rows, 1, 1, self.block_size)
        self.stepping = True

    def prepare_rows(self, lengths: torch.Tensor) -> None:
        """Inputs of the next step for rows that each hold their own sequence from column 0:
        `lengths` (rows,) positions cached so far, where each row's new token goes."""
        columns = torch.arange(self.block_size, device=lengths.device)
        self.write_at = lengths
        self.step_positions = lengths.unsqueeze(1)
        visible = columns.unsqueeze(0) <= lengths.unsqueeze(1)
        self.step_mask = visible.reshape(lengths.size(0), 1, 1, self.block_size)
        self.stepping = True

    def store_row(self, row: int, other: KVCache) -> None:
        """`other`'s positions (one sequence, run alone) as row `row`'s, from column 0."""
        for layer, (keys, values) in enumerate(zip(other.keys, other.values, strict=True)):
            assert keys is not None and values is not None
            mine = self.keys[layer]
            if mine is None or (mine.dtype, mine.device) != (keys.dtype, keys.device):
                raise ValueError("allocate the rows first (allocate_rows)")
            mine[row, :, : other.length] = keys[0, :, : other.length]
            self.values[layer][row, :, : other.length] = values[0, :, : other.length]  # type: ignore[index]

    def move_row(self, source: int, target: int) -> None:
        for buffer in (*self.keys, *self.values):
            if buffer is not None:
                buffer[target] = buffer[source]

    def first_rows(self, rows: int) -> KVCache:
        """A cache over the first `rows` rows of this one's buffers (views: what it writes,
        this one holds)."""
        view = KVCache(len(self.keys), self.block_size)
        view.keys = [None if keys is None else keys[:rows] for keys in self.keys]
        view.values = [None if values is None else values[:rows] for values in self.values]
        return view

    def allocate_rows(self, rows: int, like: KVCache) -> None:
        """Buffers for `rows` sequences of up to `block_size` positions, in `like`'s layout."""
        for layer, keys in enumerate(like.keys):
            assert keys is not None
            shape = (rows, keys.size(1), self.block_size, keys.size(3))
            mine = self.keys[layer]
            if mine is not None and mine.shape == shape and mine.dtype == keys.dtype:
                continue
            self.new_buffers(layer, shape, keys)


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
    if cache is not None and cache.stepping:
        return cache.step_positions, cache.step_mask
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

    def kept_cache(self, positions: int) -> KVCache:
        """The cache that compiled generation keeps between calls, for `positions` (prompt and
        new tokens): its buffers stay at the addresses the compiled step's CUDA graphs were
        recorded with. It holds them rounded up to a multiple of 256 (within the context), so a
        step attends over no more than it needs and few sizes are compiled."""
        size = min(self.block_size, -(-positions // 256) * 256)
        kept: KVCache | None = self.__dict__.get("_kept_cache")
        if kept is None or kept.block_size != size:
            kept = self.__dict__["_kept_cache"] = KVCache(self.n_layer, size)
        else:
            kept.restart()
        return kept

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
        compiled: bool | None = False,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` continuations of `idx` (batch, seq); temperature 0 takes the
        most likely token. The context is the last `block_size` tokens: with the cache, a full
        cache is refilled from that window, so both ways give the same logits.

        Prompts of different lengths come left-padded, with `padding_mask` (batch, seq) True at
        real tokens, and `max_new_tokens` may be one count for each row: each row gets the tokens
        it gets alone. A row ends after its own count or at `stop_token` (which it keeps); the
        loop ends when every row has, and a row's positions after its end hold `stop_token` (0
        without one).

        `compiled` runs each new token's step compiled, at shapes that never change (the cache's
        whole buffer, a mask of the positions written): on a GPU as CUDA graphs replayed token
        after token, without a kernel launch from Python each. The prompt runs uncompiled. None:
        compiled on a GPU (the first call compiles, for seconds to a minute)."""
        if compiled is None:
            compiled = idx.device.type == "cuda"
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
        next_token = idx[:, -1:]
        for step in range(max(counts, default=0)):
            window = None if real is None else real[:, -self.block_size :]
            if not kv_cache:
                logits = self(idx[:, -self.block_size :], padding_mask=window)
            elif cache is None or cache.length >= cache.block_size:
                needed = idx.size(1) + max(counts) - step
                cache = self.kept_cache(needed) if compiled else self.new_cache()
                logits = self(idx[:, -self.block_size :], cache, window)
            elif compiled:
                window = None if real is None else real[:, -(cache.length + 1) :]
                cache.prepare_step(window, rows)
                if idx.device.type == "cuda":
                    # The previous step's logits, read already, may be overwritten by this replay.
                    torch.compiler.cudagraph_mark_step_begin()
                # The token sampled last, not a view of `idx`: a view's strides change with
                # the length, and each change would compile the step again.
                logits = compiled_step(idx.device.type)(self, next_token, cache)
                cache.stepping = False
                cache.advance(1)
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


FLOAT32_TINY = torch.finfo(torch.float32).tiny


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab)."""
    if temperature < FLOAT32_TINY:  # 0, or a temperature float32 holds as 0: greedy, its limit
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted to a maximum of 0 first, so that a small temperature gives -inf, never inf - inf.
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


def decode_step(net: Decoder, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    logits: torch.Tensor = net(token, cache)
    return logits


@functools.cache
def compiled_step(device_type: str) -> Callable[..., Any]:
    """`decode_step` compiled, once per process and device type: one graph for each network,
    batch size and dtype (past dynamo's limit of 8, steps run uncompiled, with its warning)."""
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(decode_step, mode=mode, dynamic=False)
