"""The memory estimate against what a real training step holds on CPU: the tensors autograd saves
in the forward pass, and the weights, gradients and AdamW state after an optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.memory.plan import (
    plan_memory,
    transformer_activation_bytes,
)
from {{ cookiecutter.package_name }}.models.lora import (
    add_adapters,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
from {{ cookiecutter.package_name }}.run.plan import strategy_of

from .helpers import compose_config

SHAPES = [(2, 64, 2, 32, 4), (4, 128, 4, 64, 2), (1, 256, 8, 128, 2), (3, 96, 3, 48, 3)]
TARGETS = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]


def model_config(layers: int, width: int, heads: int, context: int, **extra: Any) -> Any:
    net = {
        "_target_": "{{ cookiecutter.package_name }}.models.nets.gpt.GPT", "vocab_size": 256,
        "block_size": context, "n_layer": layers, "n_head": heads, "n_embd": width,
    }  # fmt: skip
    return OmegaConf.create({"net": {**net, **extra.pop("net", {})}, **extra})


def saved_by_forward(net: GPT, batch: int, mixed: bool) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass, the parameters'
    own storage left out (it is counted as weights)."""
    parameters = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, 256, (batch, net.block_size))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed),
    ):
        logits = net(tokens)
        F.cross_entropy(logits.view(-1, logits.size(-1)), tokens.view(-1))
    return sum(saved.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_activations_and_autocast_copies_match_what_the_forward_pass_saves(
    shape: tuple[int, int, int, int, int], precision: str
) -> None:
    """Within 5 %: the estimate is a formula, the measurement every saved tensor."""
    layers, width, heads, context, batch = shape
    net = GPT(256, context, layers, heads, width).train()
    measured = saved_by_forward(net, batch, precision == "bf16-mixed")
    plan = plan_memory(model_config(*shape[:4]), batch, precision, 1, False)
    parameters = sum(p.numel() for p in net.parameters())
    copies = plan.weights - parameters * 4  # the 16-bit weight copies (none in float32)
    assert plan.activations is not None
    estimate = plan.activations + copies
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_activation_checkpointing_keeps_only_block_inputs(
    shape: tuple[int, int, int, int, int],
) -> None:
    """What the forward pass saves, plus one block's activations recomputed in the backward."""
    layers, width, heads, context, batch = shape
    net = GPT(256, context, layers, heads, width, activation_checkpointing=True).train()
    measured = saved_by_forward(net, batch, mixed=False)
    one_block = transformer_activation_bytes(GPT(256, context, 1, heads, width), batch, "32-true")
    full = transformer_activation_bytes(GPT(256, context, layers, heads, width), batch, "32-true")
    estimate = transformer_activation_bytes(net, batch, "32-true")
    assert measured <= estimate <= measured + one_block, (measured, estimate, one_block)
    assert estimate < full


@pytest.mark.parametrize("lora", [False, True])
def test_weights_gradients_and_optimizer_state_match_a_real_step(lora: bool) -> None:
    adapters = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": TARGETS}
    extra = {"lora": adapters}
    plan = plan_memory(
        model_config(2, 64, 2, 32, **(extra if lora else {})), 2, "32-true", 1, False
    )
    net = GPT(256, 32, 2, 2, 64)
    if lora:
        add_adapters(net, **extra["lora"])
    trained = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    logits = net(torch.randint(0, 256, (2, 32)))
    logits.sum().backward()
    optimizer.step()
    tensors = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    assert plan.weights == sum(p.nbytes for p in {id(p): p for p in net.parameters()}.values())
    assert plan.gradients == sum(p.grad.nbytes for p in trained if p.grad is not None)
    assert plan.optimizer == sum(t.nbytes for t in tensors)
    assert (plan.parts["trained"] < plan.parts["parameters"] / 5) == lora


def test_an_fp8_estimate_is_the_bf16_one_and_says_it_is_an_upper_bound() -> None:
    bf16 = plan_memory(model_config(2, 64, 2, 32), 4, "bf16-mixed", 1, False)
    fp8 = plan_memory(model_config(2, 64, 2, 32, fp8="tensorwise"), 4, "bf16-mixed", 1, False)
    assert fp8.total == bf16.total
    assert "upper bound" in fp8.summary() and "upper bound" not in bf16.summary()


@pytest.mark.parametrize("strategy", ["model_parallel", "fsdp"])
def test_sharding_divides_weights_gradients_and_optimizer_but_not_activations(
    strategy: str, tmp_path: Path
) -> None:
    """The strategies as their configs build them, and as Lightning's names."""
    config = model_config(2, 64, 2, 32)
    built = {
        name: compose_config("train", [f"strategy={name}"], tmp_path).trainer.strategy
        for name in ("ddp", strategy)
    }
    whole = plan_memory(config, 4, "bf16-mixed", 4, strategy_of(built["ddp"]).shards)
    for sharding in (built[strategy], strategy):
        sharded = plan_memory(config, 4, "bf16-mixed", 4, strategy_of(sharding).shards)
        assert sharded.sharded and not whole.sharded, sharding
        assert sharded.optimizer == whole.optimizer // 4
        assert sharded.activations == whole.activations
