"""The schemas of the project's own settings (Hydra Structured Configs): each command's primary
config names its schema first in its defaults list (`- train_schema`), so Hydra refuses a value
of the wrong type or a key that is not a setting while it composes, before anything runs. What
users configure with a `_target_` (data, model, trainer, callbacks, logger) stays free-form
(`Any`): the target gate (`targets.build`) checks it. Only the standard library, Hydra and
OmegaConf here: `--help` and `--cfg job` import this module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class Paths:
    """Folders; interpolations such as `${oc.env:PROJECT_ROOT,.}` are resolved when read."""

    root_dir: str = MISSING
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class Extras:
    print_config: bool = False
    ignore_warnings: bool = False


@dataclass
class Monitor:
    """The metric that checkpointing and early stopping watch."""

    metric: str = MISSING
    mode: str = "min"


# The fields of each schema, in the order in which `--cfg job` prints them.


@dataclass
class Train:
    task_name: str = MISSING
    tags: list[str] = field(default_factory=list)
    seed: int | None = None
    run_name: str | None = None
    resume: bool = True
    extend: bool = False
    ckpt_path: str | None = None
    init_from: str | None = None
    trust_checkpoint: Any = False  # true only as a YAML boolean: run/settings.py SWITCHES
    allowed_targets: list[str] = field(default_factory=list)
    test: bool = True
    monitor: Monitor = field(default_factory=Monitor)
    optimized_metric: str | None = None
    matmul_precision: str | None = "high"
    data: Any = None
    model: Any = None
    callbacks: Any = None
    logger: Any = None
    trainer: Any = None
    paths: Paths = field(default_factory=Paths)
    extras: Extras = field(default_factory=Extras)


@dataclass
class Bench:
    warmup: int = 10
    steps: int = 50
    plain: bool = True
{%- if cookiecutter.examples != "vision" %}
    peer: str | None = "nanogpt"
{%- endif %}
    matmul_size: int | None = None
    find_batch_size: bool = False
    generation: bool = False
    batch: int = 1
    prompt_tokens: int = 16
    new_tokens: int = 100
    repeats: int = 3
    compile_decode: bool | None = None
{%- if cookiecutter.examples != "vision" %}
    prepare: bool = False
    prepare_overrides: list[str] = field(default_factory=list)
{%- endif %}
    checkpointing: bool = False
    save_every: int = 10
    output: str = MISSING


@dataclass
class BenchCommand(Train):
    bench: Bench = field(default_factory=Bench)


def over_train(schema: type[Train]) -> Train:
    """`schema`, whose fields that train's config sets are left missing: merged after it (as
    `bench.yaml` names it), it types them without putting back their defaults."""
    return schema(**{item.name: MISSING for item in dataclasses.fields(Train)})


@dataclass
class Command:
    """The start of the other commands' configs."""

    paths: Paths = field(default_factory=Paths)
    extras: Extras = field(default_factory=Extras)
    task_name: str = MISSING


@dataclass
class FromCheckpoint(Command):
    """A command that rebuilds a trained model: the model and data configs are merged over those
    its checkpoint stores."""

    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    seed: int | None = None
    ckpt_path: str | None = MISSING
    trust_checkpoint: Any = False  # true only as a YAML boolean: run/settings.py SWITCHES
    allowed_targets: list[str] = field(default_factory=list)
    data: Any = field(default_factory=dict)
    model: Any = field(default_factory=dict)


@dataclass
class Tested(FromCheckpoint):
    """A command that runs a checkpoint with a trainer."""

    callbacks: Any = None
    logger: Any = None
    trainer: Any = None
    matmul_precision: str | None = "high"


@dataclass
class Evaluate(Tested):
    """Eval: the test split's metrics of a checkpoint."""


@dataclass
class Predict(Tested):
    inputs: Any = None  # files and folders: one path or a list of them, or `test`
    top_k_classes: int = 3
    prompt: str | None = None
    prompt_file: str | None = None
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 50
    kv_cache: bool = True
    compile_decode: bool | None = None
    stream: bool = True
    chat: bool = False


@dataclass
class Export(FromCheckpoint):
    format: str = "pt2"
    output: str | None = None
    tolerance: float = 1.0e-4


@dataclass
class ServeLimits:
    request_bytes: int = 1048576
    max_new_tokens: int = 2048
    image_pixels: int = 16777216
    queued_requests: int = 1024
    connections: int | None = None
    header_seconds: float = 10.0
    body_seconds: float = 30.0


@dataclass
class Serve(FromCheckpoint):
    """A server of a checkpoint."""

    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    matmul_precision: str | None = "high"
    max_batch_size: int = 16
    batch_timeout: float = 0.01
    compile_decode: bool = False
    shutdown_timeout: int = 10
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 50
    top_k_classes: int = 3
    limits: ServeLimits = field(default_factory=ServeLimits)
{%- if cookiecutter.examples != "vision" %}


@dataclass
class Prepare(Command):
    tags: list[str] = field(default_factory=list)
    source: str | None = "stdlib"
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    max_bytes: int | None = None
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    shard_tokens: int | None = 100_000_000
    workers: int | None = None
    output: str | None = MISSING
{%- endif %}


# Each primary config (configs/<command>.yaml) names `<command>_schema` first in its defaults.
SCHEMAS: dict[str, Any] = {
    "train": Train,
    "bench": over_train(BenchCommand),
    "eval": Evaluate,
    "predict": Predict,
    "export": Export,
    "serve": Serve,
{%- if cookiecutter.examples != "vision" %}
    "prepare": Prepare,
{%- endif %}
}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (again, where a test cleared it)."""
    store = ConfigStore.instance()
    for command, schema in SCHEMAS.items():
        store.store(name=f"{command}_schema", node=schema)
