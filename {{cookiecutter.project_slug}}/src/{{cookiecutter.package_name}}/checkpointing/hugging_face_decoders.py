"""A Hugging Face Llama, Qwen2, Qwen3 or Mistral checkpoint (a folder with `config.json` and
`model.safetensors`, or shards named by `model.safetensors.index.json`, as the Hub holds e.g.
HuggingFaceTB/SmolLM2-135M-Instruct, Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen3-0.6B,
meta-llama/Llama-3.2-1B-Instruct or mistralai/Mistral-7B-Instruct-v0.3) as the weights of this
project's Llama-family decoder (models/nets/llama.py).

Every file is read by the door (JSON and safetensors: neither can name code). config.json must
describe the configured network, or one error names the overrides that build it; what the
network does not compute (another activation, a sliding window shorter than the context, a RoPE
scaling other than linear or Llama 3's) is refused. Every name and shape is checked against the
built network before any weight is loaded."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..models.lora import is_adapter
from ..models.nets.llama import ROPE_TYPES, Llama
from .differences import shape_differences
from .door import HF_CONFIG, HF_INDEX, HF_WEIGHTS, read_json_fields, read_safetensors_folder

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
DOWNLOAD = "hf download HuggingFaceTB/SmolLM2-135M-Instruct"
WHOLE, NUMBER, SWITCH = "a whole number", "a number", "true or false"
CONFIG_FIELDS = {
    "model_type": "a string",
    "vocab_size": WHOLE,
    "hidden_size": WHOLE,
    "num_hidden_layers": WHOLE,
    "num_attention_heads": WHOLE,
    "num_key_value_heads": "a whole number or null",
    "head_dim": "a whole number or null",
    "intermediate_size": WHOLE,
    "max_position_embeddings": WHOLE,
    "rms_norm_eps": NUMBER,
    "rope_theta": NUMBER,
    "rope_scaling": "an object or null",
    "rope_parameters": "an object or null",
    "hidden_act": "a string",
    "tie_word_embeddings": SWITCH,
    "attention_bias": SWITCH,
    "mlp_bias": SWITCH,
    "sliding_window": "a whole number or null",
    "use_sliding_window": SWITCH,
}
REQUIRED = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings",
)  # fmt: skip
# The numbers each kind of RoPE scaling needs.
SCALING_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Hugging Face's names inside a layer -> the Llama's, inside its block.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn": "attn",
    "mlp": "mlp",
}
TOP_NAMES = {"embed_tokens.weight": "wte.weight", "norm.weight": "norm.weight"}


def read_rope(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and scaling: transformers 5 writes both in `rope_parameters`, older versions
    `rope_theta` and `rope_scaling` (whose kind is `rope_type`, or `type`)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if not isinstance(kind, str) or kind not in SCALING_FIELDS:
        raise ConfigError(
            f"{where} scales its rotary embeddings as {json_text(kind)}, which this project's "
            f"decoder does not compute (it does {', '.join(ROPE_TYPES)})."
        )
    if not positive_number(theta):
        raise ConfigError(
            f"{where}: its {HF_CONFIG} has rope_theta={json_text(theta)}, not a positive "
            "number: download it again."
        )
    scaling: dict[str, Any] = {"rope_type": kind}
    for name in SCALING_FIELDS[kind]:
        value = params.get(name)
        if not positive_number(value):
            raise ConfigError(
                f"{where}: its {HF_CONFIG} scales RoPE as {kind} without a positive {name}: "
                "download it again."
            )
        scaling[name] = value
    return float(theta), None if kind == "default" else scaling


def positive_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def json_text(value: Any) -> str:
    return repr(value)[:80]


def read_config(path: Path, key: str) -> dict[str, Any]:
    """config.json, checked to describe a model that the Llama computes as transformers does."""
    config = read_json_fields(path, CONFIG_FIELDS, REQUIRED[:1], key)
    where = f"{key}={path.parent}"
    family = config["model_type"]
    if family not in FAMILIES:
        raise ConfigError(
            f"{where} is a Hugging Face {family!r} model: the decoders this project converts "
            f"are {', '.join(FAMILIES)} (and gpt2)."
        )
    missing = [name for name in REQUIRED if name not in config]
    if missing:
        raise ConfigError(
            f"{where}: its {HF_CONFIG} has no {', '.join(missing)}: it is not the config of a "
            f"{family} model; download it again."
        )
    for name in REQUIRED[1:]:
        if config[name] < 1:
            raise ConfigError(f"{where}: its {HF_CONFIG} has {name}={config[name]}, not a size.")
    if not positive_number(config.get("rms_norm_eps", 1e-6)):
        raise ConfigError(
            f"{where}: its {HF_CONFIG} has rms_norm_eps={json_text(config['rms_norm_eps'])}, not "
            "a positive number: download it again."
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{where} uses hidden_act={config['hidden_act']}, and this project's decoder the "
            "SiLU of Llama's SwiGLU."
        )
    return config


def settings_of_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The Llama's constructor arguments that this checkpoint needs (block_size aside)."""
    family = config["model_type"]
    theta, scaling = read_rope(config, where)
    heads = config["num_attention_heads"]
    bias = config.get("attention_bias", False)
    return {
        "vocab_size": config["vocab_size"],
        "n_layer": config["num_hidden_layers"],
        "n_head": heads,
        "n_embd": config["hidden_size"],
        "n_kv_head": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "mlp_width": config["intermediate_size"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "qkv_bias": family == "qwen2" or bias,
        "out_bias": family != "qwen2" and bias,
        "mlp_bias": config.get("mlp_bias", False),
        "qk_norm": family == "qwen3",
        "tie_embeddings": config.get("tie_word_embeddings", family != "llama"),
    }


def settings_of_net(net: Llama) -> dict[str, Any]:
    first: Any = net.blocks[0] if len(net.blocks) else None
    attn = first.attn if first is not None else None
    mlp = first.mlp if first is not None else None
    return {
        "vocab_size": net.vocab_size,
        "n_layer": net.n_layer,
        "n_head": net.n_head,
        "n_embd": net.n_embd,
        "n_kv_head": net.n_kv_head,
        "head_dim": net.head_dim,
        "mlp_width": net.mlp_width,
        "rope_theta": net.rope_theta,
        "rope_scaling": net.rope_scaling,
        "norm_eps": net.norm.eps,
        "qkv_bias": attn is not None and attn.q_proj.bias is not None,
        "out_bias": attn is not None and attn.o_proj.bias is not None,
        "mlp_bias": mlp is not None and mlp.gate_proj.bias is not None,
        "qk_norm": attn is not None and attn.q_norm is not None,
        "tie_embeddings": net.tie_embeddings,
    }


def override(name: str, value: Any) -> str:
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, dict):
        text = "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    elif value is None:
        text = "null"
    else:
        text = str(value)
    return f"model.net.{name}={text}"


def same(wanted: Any, built: Any) -> bool:
    if isinstance(wanted, float) or isinstance(built, float):
        return built is not None and math.isclose(float(wanted), float(built), rel_tol=1e-6)
    return bool(wanted == built)


def check_network(config: dict[str, Any], net: Llama, folder: Path, key: str) -> None:
    """The configured network is the checkpoint's, its context within the checkpoint's, or one
    error with the overrides that make it so."""
    where = f"{key}={folder}"
    wanted, built = settings_of_config(config, where), settings_of_net(net)
    overrides = [override(n, v) for n, v in wanted.items() if not same(v, built[n])]
    limit = config["max_position_embeddings"]
    window = config.get("sliding_window")
    if config["model_type"] == "qwen2" and not config.get("use_sliding_window", False):
        window = None
    if window is not None:
        limit = min(limit, window)
    if net.block_size > limit:
        overrides.append(override("block_size", limit))
    if overrides:
        raise ConfigError(
            f"{where} is a {config['model_type']} model of {wanted['n_layer']} layers, "
            f"{wanted['n_head']} heads ({wanted['n_kv_head']} for keys and values), "
            f"{wanted['n_embd']} wide, with {wanted['vocab_size']} tokens, and the configured "
            f"model is not (or its context is longer than the checkpoint's {limit}): add "
            f"{' '.join(overrides)}"
        )


def llama_name(name: str) -> str | None:
    """The Llama's name for a checkpoint's tensor; None for a stored RoPE buffer. KeyError for a
    name these families do not have."""
    short = name.removeprefix("model.")
    if short in TOP_NAMES:
        return TOP_NAMES[short]
    if name == "lm_head.weight":
        return name
    layer = re.fullmatch(r"layers\.(\d+)\.([a-z_]+)\.(.+)", short)
    if layer is None or layer.group(2) not in LAYER_NAMES:
        raise KeyError(name)
    if layer.group(3) == "rotary_emb.inv_freq":
        return None
    return f"blocks.{int(layer.group(1))}.{LAYER_NAMES[layer.group(2)]}.{layer.group(3)}"


def converted(
    tensors: dict[str, torch.Tensor], net: Llama, folder: Path, key: str
) -> dict[str, torch.Tensor]:
    """The Llama's weights from the checkpoint's tensors, each name and shape checked."""
    where = f"{key}={folder}: its weights"
    tied = net.tie_embeddings
    expected = {
        name: tuple(value.shape)
        for name, value in net.state_dict().items()
        if not is_adapter(name) and not (tied and name == "lm_head.weight")
    }
    weights: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for name, value in tensors.items():
        try:
            target = llama_name(name)
        except KeyError:
            unknown.append(name)
            continue
        if target is None:
            continue
        if not value.is_floating_point():
            raise ConfigError(f"{where} hold {name} as {value.dtype}, not as weights.")
        weights[target] = value
    head = weights.pop("lm_head.weight", None) if tied else None
    if head is not None and not torch.equal(head, weights.get("wte.weight", head)):
        raise ConfigError(
            f"{where} hold an output layer apart from the token embedding, and its {HF_CONFIG} "
            "says the two are tied: download both again, from the same model."
        )
    stored = {name: tuple(value.shape) for name, value in weights.items()}
    details = shape_differences(expected, stored | {name: () for name in unknown})
    if details:
        raise ConfigError(
            f"{where} do not hold the model its {HF_CONFIG} describes ({details}): download "
            "the model's files again, all from the same revision."
        )
    return weights


def network(model: torch.nn.Module, folder: Path, family: str, key: str) -> Llama:
    net = model if isinstance(model, Llama) else getattr(model, "net", None)
    if not isinstance(net, Llama):
        raise ConfigError(
            f"{key}={folder} is a Hugging Face {family} checkpoint, and the configured network "
            "is not the Llama-family decoder: choose one (e.g. experiment=smollm2_instruct)."
        )
    return net


def load_llama_family(model: torch.nn.Module, folder: Path, key: str = "init_from") -> None:
    """The Llama of `model` (a language model, or a Llama itself) gets the checkpoint's weights;
    one error line, before any weight changes, where the folder does not fit it."""
    if not (folder / HF_WEIGHTS).is_file() and not (folder / HF_INDEX).is_file():
        raise ConfigError(
            f"{key}={folder} has {HF_CONFIG} but neither {HF_WEIGHTS} nor {HF_INDEX}: download "
            f"the model's safetensors, e.g. {DOWNLOAD} --local-dir {folder}"
        )
    config = read_config(folder / HF_CONFIG, key)
    net = network(model, folder, config["model_type"], key)
    check_network(config, net, folder, key)
    weights = converted(read_safetensors_folder(folder, key), net, folder, key)
    with torch.no_grad():
        parameters = net.state_dict()
        for name, value in weights.items():
            parameters[name].copy_(value)
