"""A Hugging Face GPT-2 checkpoint (a folder with `config.json` and `model.safetensors`, as the
Hub's gpt2, gpt2-medium, gpt2-large and gpt2-xl hold them) as the weights of this project's GPT.

Both files are read by the door (JSON and safetensors: neither can name code); weights that are
only a pickle (`pytorch_model.bin`) are refused. The sizes in config.json must be those of the
configured model, or one error names the overrides that build it; what no override can change
(another activation, LayerNorm epsilon or attention) is refused. GPT-2's attention and MLP
matrices are Conv1D layers, stored (in, out): they are transposed into Linear's (out, in), as
nanoGPT's `from_pretrained` does. Every name and shape is checked against the built model before
any weight is loaded."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ..data.folder_files import file_in_folder
from ..errors import ConfigError
from ..models.lora import is_adapter
from ..models.nets.gpt import GPT
from .differences import shape_differences
from .door import (
    HF_CONFIG,
    HF_PICKLED,
    HF_WEIGHTS,
    read_json_fields,
    read_safetensors,
)
from .hugging_face_decoders import load_llama_family

DOWNLOAD = "hf download openai-community/gpt2 config.json model.safetensors tokenizer.json"

# What the converter reads from config.json; the rest (dropouts, generation settings) it leaves.
CONFIG_FIELDS = {
    "model_type": "a string",
    "vocab_size": "a whole number",
    "n_positions": "a whole number",
    "n_embd": "a whole number",
    "n_layer": "a whole number",
    "n_head": "a whole number",
    "n_inner": "a whole number or null",
    "activation_function": "a string",
    "layer_norm_epsilon": "a number",
    "tie_word_embeddings": "true or false",
    "scale_attn_weights": "true or false",
    "scale_attn_by_inverse_layer_idx": "true or false",
    "add_cross_attention": "true or false",
}
REQUIRED = ("model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# How this GPT computes, where a GPT-2 config could say otherwise (a missing key means
# transformers' default, which is this).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
LAYER_NORM_EPSILON = 1e-5  # nn.LayerNorm's default, which the GPT's layers keep
SWITCHES = {
    "tie_word_embeddings": True,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}

# GPT-2's names (after an optional `transformer.` prefix) -> the GPT's, and whether a Conv1D
# weight is transposed.
TOP_NAMES = {
    "wte.weight": "wte.weight",
    "wpe.weight": "wpe.weight",
    "ln_f.weight": "ln_f.weight",
    "ln_f.bias": "ln_f.bias",
}
BLOCK_NAMES = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.c_attn.weight": ("attn.qkv.weight", True),
    "attn.c_attn.bias": ("attn.qkv.bias", False),
    "attn.c_proj.weight": ("attn.proj.weight", True),
    "attn.c_proj.bias": ("attn.proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.c_fc.weight": ("mlp.fc.weight", True),
    "mlp.c_fc.bias": ("mlp.fc.bias", False),
    "mlp.c_proj.weight": ("mlp.proj.weight", True),
    "mlp.c_proj.bias": ("mlp.proj.bias", False),
}
# The causal masks that files saved by older transformers hold: buffers, not weights.
MASKS = ("attn.bias", "attn.masked_bias")
TIED_HEAD = "lm_head.weight"


def checked_files(folder: Path, key: str) -> tuple[Path, Path]:
    """config.json and model.safetensors, or one error saying what to download."""
    config, weights = folder / HF_CONFIG, folder / HF_WEIGHTS
    for name in (HF_CONFIG, HF_WEIGHTS):  # a link out, a device or a pipe: refused unopened
        file_in_folder(folder, name, f"{key}={folder}")
    if not weights.is_file():
        if (folder / HF_PICKLED).exists():
            raise ConfigError(
                f"{key}={folder} holds its weights only as {HF_PICKLED}, a pickle, which this "
                f"project never loads (unpickling can run code stored in the file): get the "
                f"model's {HF_WEIGHTS} instead, e.g. {DOWNLOAD} --local-dir {folder}"
            )
        raise ConfigError(
            f"{key}={folder} has {HF_CONFIG} but no {HF_WEIGHTS}: download it, e.g. {DOWNLOAD} "
            f"--local-dir {folder}"
        )
    if not config.is_file():
        raise ConfigError(
            f"{key}={folder} has {HF_WEIGHTS} but no {HF_CONFIG}, which gives its sizes: "
            f"download it too, e.g. {DOWNLOAD} --local-dir {folder}"
        )
    return config, weights


def read_config(path: Path, key: str) -> dict[str, Any]:
    """config.json, checked to describe a GPT-2 that this GPT computes as transformers does."""
    config = read_json_fields(path, CONFIG_FIELDS, REQUIRED, key)
    where = f"{key}={path.parent}"
    if config["model_type"] != "gpt2":
        raise ConfigError(
            f"{where} is a Hugging Face {config['model_type']!r} model: only GPT-2 checkpoints "
            "(model_type gpt2) convert to this project's GPT."
        )
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if config[name] < 1:
            raise ConfigError(f"{where}: its {HF_CONFIG} has {name}={config[name]}, not a size.")
    unlike = []
    activation = config.get("activation_function", TANH_GELU[0])
    if activation not in TANH_GELU:
        unlike.append(f"activation_function={activation} (this GPT uses the tanh GELU)")
    epsilon = config.get("layer_norm_epsilon", LAYER_NORM_EPSILON)
    if not math.isclose(epsilon, LAYER_NORM_EPSILON, rel_tol=1e-6):
        unlike.append(f"layer_norm_epsilon={epsilon} (this GPT's is {LAYER_NORM_EPSILON})")
    inner = config.get("n_inner")
    if inner is not None and inner != 4 * config["n_embd"]:
        unlike.append(f"n_inner={inner} (this GPT's MLP is 4 x n_embd wide)")
    for name, value in SWITCHES.items():
        if config.get(name, value) != value:
            unlike.append(f"{name}={str(not value).lower()}")
    if unlike:
        raise ConfigError(
            f"{where} is a GPT-2 variant that this project's GPT does not compute: "
            f"{', '.join(unlike)}."
        )
    return config


def sizes_of_config(config: dict[str, Any]) -> dict[str, int | bool]:
    return {
        "n_layer": config["n_layer"],
        "n_head": config["n_head"],
        "n_embd": config["n_embd"],
        "vocab_size": config["vocab_size"],
        "block_size": config["n_positions"],
        "bias": True,
    }


def sizes_of_net(net: GPT) -> dict[str, int | bool]:
    return {
        "n_layer": net.n_layer,
        "n_head": net.n_head,
        "n_embd": net.n_embd,
        "vocab_size": net.vocab_size,
        "block_size": net.block_size,
        "bias": net.ln_f.bias is not None,
    }


def check_sizes(config: dict[str, Any], net: GPT, folder: Path, key: str) -> None:
    """The configured model is the checkpoint's, or one error with the overrides that make it."""
    wanted, built = sizes_of_config(config), sizes_of_net(net)
    overrides = [
        f"model.net.{name}={str(value).lower() if isinstance(value, bool) else value}"
        for name, value in wanted.items()
        if built[name] != value
    ]
    if overrides:
        raise ConfigError(
            f"{key}={folder} is a GPT-2 of {config['n_layer']} layers, {config['n_head']} heads, "
            f"{config['n_embd']} wide, with {config['vocab_size']} tokens and a context of "
            f"{config['n_positions']}, and the configured model is not: add "
            f"{' '.join(overrides)}"
        )


def gpt_name(name: str) -> tuple[str, bool] | None:
    """The GPT's name for a GPT-2 tensor and whether it is transposed; None for a mask buffer.
    KeyError for a name GPT-2 does not have."""
    short = name.removeprefix("transformer.")
    if short in TOP_NAMES:
        return TOP_NAMES[short], False
    block = re.fullmatch(r"h\.(\d+)\.(.+)", short)
    if block and block.group(2) in MASKS:
        return None
    if block and block.group(2) in BLOCK_NAMES:
        target, transposed = BLOCK_NAMES[block.group(2)]
        return f"blocks.{int(block.group(1))}.{target}", transposed
    raise KeyError(name)


def converted(
    tensors: dict[str, torch.Tensor], net: GPT, folder: Path, key: str
) -> dict[str, torch.Tensor]:
    """The GPT's weights from GPT-2's tensors, each name and shape checked against `net`."""
    where = f"{key}={folder}: its {HF_WEIGHTS}"
    expected = {
        name: tuple(value.shape)
        for name, value in net.state_dict().items()
        if name != "lm_head.weight" and not is_adapter(name)  # the head is the embedding
    }
    weights: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for name, value in tensors.items():
        if name == TIED_HEAD:
            continue
        try:
            found = gpt_name(name)
        except KeyError:
            unknown.append(name)
            continue
        if found is None:
            continue
        target, transposed = found
        if not value.is_floating_point():
            raise ConfigError(f"{where} holds {name} as {value.dtype}, not as weights.")
        weights[target] = value.t() if transposed else value
    stored = {name: tuple(value.shape) for name, value in weights.items()}
    details = shape_differences(expected, stored | {name: () for name in unknown})
    if details:
        raise ConfigError(
            f"{where} does not hold the GPT-2 its {HF_CONFIG} describes ({details}): "
            "download both files again, from the same model."
        )
    head = tensors.get(TIED_HEAD)
    if head is not None and not torch.equal(head, tensors[embedding_name(tensors)]):
        raise ConfigError(
            f"{where} holds an output layer ({TIED_HEAD}) apart from the token embedding, and "
            "this GPT ties the two, as GPT-2 does: it is not a GPT-2 checkpoint."
        )
    return weights


def embedding_name(tensors: dict[str, torch.Tensor]) -> str:
    return "transformer.wte.weight" if "transformer.wte.weight" in tensors else "wte.weight"


def network(model: torch.nn.Module, folder: Path, key: str) -> GPT:
    net = model if isinstance(model, GPT) else getattr(model, "net", None)
    if not isinstance(net, GPT):
        raise ConfigError(
            f"{key}={folder} is a Hugging Face GPT-2 checkpoint, and the configured model is not "
            "a GPT: choose a language model (e.g. experiment=gpt2_pretrained)."
        )
    return net


def load_hugging_face(model: torch.nn.Module, folder: Path, key: str = "init_from") -> None:
    """The GPT of `model` (a language model, or a GPT itself) gets the checkpoint's weights, or,
    for a Llama-family checkpoint, its Llama does; one error line, before any weight changes,
    where the folder does not fit it."""
    if (folder / HF_CONFIG).is_file():
        kind = read_json_fields(folder / HF_CONFIG, {"model_type": "a string"}, (), key)
        if kind.get("model_type", "gpt2") != "gpt2":  # the Llama family, or one error naming it
            load_llama_family(model, folder, key)
            return
    config_path, weights_path = checked_files(folder, key)
    config = read_config(config_path, key)
    net = network(model, folder, key)
    check_sizes(config, net, folder, key)
    weights = converted(read_safetensors(weights_path, key), net, folder, key)
    with torch.no_grad():
        parameters = net.state_dict()
        for name, value in weights.items():
            parameters[name].copy_(value)
