"""The chunked loss (models/losses.py) gives the plain cross-entropy's loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.models.lora import (
    add_adapters,
)
from {{ cookiecutter.package_name }}.models.losses import (
    IGNORED,
    chunked_cross_entropy,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import GPT

VOCAB = 96


def tiny_gpt(chunk: int | None, n_embd: int = 32, checkpointing: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(
        vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=n_embd,
        activation_checkpointing=checkpointing, loss_chunk_size=chunk,
    )  # fmt: skip


def batch(ignored: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (3, 16), generator=generator)
    targets = torch.randint(0, VOCAB, (3, 16), generator=generator)
    if ignored:  # as instruction data marks them: a prompt, and padding after a short response
        targets[0, :5] = IGNORED
        targets[2, 11:] = IGNORED
    return inputs, targets


def plain_loss(net: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = net(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORED)


def gradients(net: GPT, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 7, 16, 47], ids=lambda chunk: f"chunk{chunk}")
@pytest.mark.parametrize("ignored", [True, False], ids=["ignored", "all-counted"])
def test_the_chunked_loss_and_every_gradient_are_the_plain_ones(chunk: int, ignored: bool) -> None:
    """In float32, chunks that divide the 48 positions and chunks that do not, with targets of
    -100 (prompt and padding of instruction data) and without."""
    net = tiny_gpt(chunk)
    inputs, targets = batch(ignored)
    expected_loss = plain_loss(net, inputs, targets)
    expected = gradients(net, expected_loss)
    loss = net(inputs, targets=targets)
    found = gradients(net, loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert found.keys() == expected.keys() == {name for name, _ in net.named_parameters()}
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_tied_embedding_gets_both_of_its_gradients() -> None:
    """lm_head's weight is the token embedding's: its gradient sums the embedding's and the
    head's, as in the plain way (and the head's part is not zero)."""
    net = tiny_gpt(8)
    inputs, targets = batch()
    assert net.lm_head.weight is net.wte.weight
    grad = gradients(net, net(inputs, targets=targets))["wte.weight"]
    unused = sorted(set(range(VOCAB)) - set(inputs.flatten().tolist()))
    assert unused and grad[unused].abs().sum() > 0, "rows no input used get the head's gradient"
    torch.testing.assert_close(grad, gradients(net, plain_loss(net, inputs, targets))["wte.weight"])


def test_without_gradients_the_loss_is_the_same_and_nothing_is_kept() -> None:
    """Validation and test: no gradient is computed beside the loss, and the loss is the same."""
    net = tiny_gpt(5).eval()
    inputs, targets = batch()
    with torch.no_grad():
        loss = net(inputs, targets=targets)
        assert loss.grad_fn is None
        torch.testing.assert_close(loss, plain_loss(net, inputs, targets))


def test_with_no_target_counted_the_loss_is_nan_as_the_plain_one() -> None:
    net = tiny_gpt(4)
    inputs, targets = batch()
    targets[:] = IGNORED
    assert plain_loss(net, inputs, targets).isnan()
    loss = net(inputs, targets=targets)
    assert loss.isnan()
    assert all(grad.isfinite().all() for grad in gradients(net, loss).values())


def test_under_bf16_autocast_it_stays_within_bf16_of_the_plain_way() -> None:
    """The products in bfloat16 as the plain way's under autocast, the softmax in float32."""
    net = tiny_gpt(10)
    inputs, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss = plain_loss(net, inputs, targets)
        loss = net(inputs, targets=targets)
    expected, found = gradients(net, expected_loss), gradients(net, loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=1e-3)
    for name, grad in expected.items():
        assert found[name].dtype == grad.dtype == torch.float32
        scale = grad.abs().max().item()
        torch.testing.assert_close(found[name], grad, rtol=0.0, atol=0.02 * scale, msg=name)


@pytest.mark.parametrize(
    "targets",
    [["attn.qkv", "mlp.fc"], ["attn.qkv", "lm_head"]],
    ids=["lora", "lora-on-the-head"],
)
def test_lora_adapters_get_the_plain_gradients(targets: list[str]) -> None:
    """Frozen weights get no gradient (none is computed for the frozen head); an adapted head
    goes the plain way."""
    net = tiny_gpt(6)
    add_adapters(net, rank=2, alpha=4.0, dropout=0.0, target_modules=targets)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(std=0.1)  # adapters that change the output
    inputs, targets_ = batch()
    expected = gradients(net, plain_loss(net, inputs, targets_))
    found = gradients(net, net(inputs, targets=targets_))
    assert found.keys() == expected.keys() and all("lora_" in name for name in found)
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    inputs, targets = batch()
    plain = tiny_gpt(None)
    expected = gradients(plain, plain(inputs, targets=targets))
    net = tiny_gpt(9, checkpointing=True).train()
    found = gradients(net, net(inputs, targets=targets))
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_the_loss_compiles_with_the_network_in_one_graph() -> None:
    """torch.compile traces the network and the chunked loss (forward and backward) without a
    graph break (`fullgraph=True`); the AOT-autograd backend keeps the test to seconds."""
    net = tiny_gpt(12)
    inputs, targets = batch()
    expected = gradients(net, plain_loss(net, inputs, targets))
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    found = gradients(net, compiled(inputs, targets=targets))
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunks_apply_only_where_they_save_memory() -> None:
    """One chunk or more positions, or logits narrower than the hidden states: the plain way
    (its backward is the cross-entropy's own)."""
    inputs, targets = batch()
    for net in (tiny_gpt(48), tiny_gpt(None), tiny_gpt(4, n_embd=128)):
        assert "NllLoss" in type(net(inputs, targets=targets).grad_fn).__name__
    assert "Chunked" in type(tiny_gpt(47)(inputs, targets=targets).grad_fn).__name__


@pytest.mark.parametrize("size", [0, -3])
def test_a_chunk_size_below_one_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match=f"loss_chunk_size={size} must be 1 or more"):
        GPT(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=32, loss_chunk_size=size)
    with pytest.raises(ValueError, match=f"chunk_size={size}"):
        chunked_cross_entropy(torch.zeros(4, 2), torch.zeros(8, 2), torch.zeros(4).long(), size)
