"""Next-token cross-entropy from the network's last hidden states and its output projection.

The plain way projects every position onto the whole vocabulary and takes the cross-entropy of
those logits in float32: at GPT-2's 50k tokens, batch 32 x 1024, the float32 logits and their
gradient alone take 12 GiB. `chunked_cross_entropy` never holds them: it takes `chunk_size`
positions at a time, computes their logits, loss and the gradients of the hidden states and of
the projection right away (the gradient of a mean cross-entropy does not depend on anything that
comes after it), and keeps only those gradients, scaled by the incoming gradient in the backward
pass. The matrix products are those of the plain way, in the same dtype (bf16 under autocast);
the softmax is in float32, one chunk at a time.

A target of -100 counts for nothing and the loss is the mean over the others, as in
`F.cross_entropy(..., ignore_index=-100)`; with no target counted the loss is NaN, as there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORED = -100


def next_token_loss(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk_size: int | None
) -> torch.Tensor:
    """The mean cross-entropy of `head(hidden)` (batch, seq, vocab) against `targets` (batch,
    seq). With `chunk_size`, `chunk_size` positions at a time where that saves memory: more
    positions than that, a vocabulary wider than the hidden states (narrower logits take less
    than the hidden states they come from), and a plain bias-free Linear head (a LoRA head goes
    the plain way)."""
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_targets = targets.reshape(-1)
    chunked = (
        chunk_size is not None
        and flat_targets.numel() > chunk_size
        and type(head) is nn.Linear
        and head.bias is None
        and head.out_features > head.in_features
    )
    if not chunked:
        logits = head(flat_hidden)
        return F.cross_entropy(logits.float(), flat_targets, ignore_index=IGNORED)
    assert isinstance(head, nn.Linear) and chunk_size is not None
    return chunked_cross_entropy(flat_hidden, head.weight, flat_targets, chunk_size)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100)` for
    `hidden` (positions, width), `weight` (vocab, width) and `targets` (positions,), computed
    `chunk_size` positions at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be 1 or more")
    grads = torch.is_grad_enabled()
    wants = (grads and hidden.requires_grad, grads and weight.requires_grad)
    if not any(wants):
        return loss_and_gradients(hidden, weight, targets, chunk_size, wants)[0]
    loss: torch.Tensor = ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_size, wants)
    return loss


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` multiplies in: autocast's, where it is on."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def loss_and_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    wants: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss, and the gradients of `hidden` and `weight` that `wants` asks for."""
    counted = targets != IGNORED
    count = counted.sum()
    # Ignored rows get no gradient, the others 1/count of theirs (the mean). The clamp only keeps
    # 0 / 0 out of the gradients when nothing counts.
    row_scale = counted.float() / count.clamp(min=1)
    dtype = matmul_dtype(hidden, weight)
    inputs, matrix = hidden.to(dtype), weight.to(dtype)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if wants[0] else None
    # Summed over the chunks in float32 (the plain way's single product rounds once).
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
    for start in range(0, targets.numel(), chunk_size):
        end = start + chunk_size
        rows, chunk_targets = inputs[start:end], targets[start:end]
        logits = (rows @ matrix.t()).float()
        log_total = torch.logsumexp(logits, dim=-1)
        picked_targets = chunk_targets.clamp(min=0).unsqueeze(1)
        picked = logits.gather(1, picked_targets).squeeze(1)
        loss_sum = loss_sum + ((log_total - picked) * counted[start:end]).sum()
        if grad_hidden is None and grad_weight is None:
            continue
        # d loss / d logits = (softmax - one_hot(target)) * row_scale, built in place.
        grad = logits.sub_(log_total.unsqueeze(1)).exp_()
        grad.scatter_add_(1, picked_targets, torch.full_like(picked, -1.0).unsqueeze(1))
        grad = grad.mul_(row_scale[start:end].unsqueeze(1)).to(dtype)
        if grad_hidden is not None:
            grad_hidden[start:end] = grad @ matrix
        if grad_weight is not None:
            grad_weight += (grad.t() @ rows).float()
    return loss_sum / count, grad_hidden, grad_weight


class ChunkedCrossEntropy(torch.autograd.Function):
    """The loss, with the gradients computed beside it (see the module), scaled in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        wants: tuple[bool, bool],
    ) -> torch.Tensor:
        loss, grad_hidden, grad_weight = loss_and_gradients(
            hidden, weight, targets, chunk_size, wants
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None
