"""FP8 training through torchao's float8 (`convert_to_float8_training`): the Linear layers' matrix
products run in float8 with dynamic scales (`tensorwise`: one scale per tensor; `rowwise`: one per
row, more accurate, a little slower). The weights stay in high precision, so checkpoints are the
same plain tensors as without FP8 and load without torchao.

Left in high precision: the output projection (`lm_head`, whose logits FP8 would coarsen), layers
whose dimensions are not multiples of 16 (float8 matrix products need them), and LoRA layers.
Under FSDP2, `tensorwise` all-gathers the weights in float8 too.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

RECIPES = ("tensorwise", "rowwise")


def converts(module: nn.Module, name: str) -> bool:
    return (
        type(module) is nn.Linear
        and name.rsplit(".", 1)[-1] != "lm_head"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def fp8_layers(net: nn.Module) -> tuple[list[str], list[str]]:
    """The Linear layers that FP8 converts, and those it leaves in high precision."""
    linears = [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    return (
        [name for name, m in linears if converts(m, name)],
        [name for name, m in linears if not converts(m, name)],
    )


def import_torchao() -> None:
    """torchao, quietly: on a machine without a GPU it logs a line for each GPU extension."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


def convert_to_fp8(net: nn.Module, recipe: str, fsdp: bool = False) -> None:
    import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(net, config=config, module_filter_fn=converts)


def convert_from_fp8(net: nn.Module) -> int:
    """Float8 layers back to plain Linear layers on the same weights (for evaluation, which
    float8's training tensors do not support under inference mode); returns how many."""
    converted = [
        (name, module)
        for name, module in net.named_modules()
        if type(module).__name__ == "Float8Linear"
    ]
    for name, module in converted:
        assert isinstance(module, nn.Linear)
        parent_name, _, child = name.rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight, linear.bias = module.weight, module.bias
        setattr(parent, child, linear)
    return len(converted)
