"""`{{ cookiecutter.package_name }}-bench`: measure an experiment on this machine.

    {{ cookiecutter.package_name }}-bench{% if cookiecutter.examples != "vision" %} experiment=gpt2_small trainer=gpu{% endif %} bench.steps=50
{%- if cookiecutter.examples != "vision" %}
    {{ cookiecutter.package_name }}-bench experiment=language bench.generation=true
    {{ cookiecutter.package_name }}-bench bench.prepare=true bench.repeats=5
{%- endif %}

By default it times the training step, in Lightning and in plain PyTorch (`training`){% if cookiecutter.examples != "vision" %}, and a
GPT's also in a plain nanoGPT-style loop with its own model (`peer`, `bench.peer=nanogpt`){% endif %}; with
`bench.generation=true`, a language model's generation speed with and without its key/value
cache (`generation`){% if cookiecutter.examples != "vision" %}; with `bench.prepare=true`, the prepare command against a plain
`tokenizers` + numpy script on the same corpus (`preparation`){% endif %}; with
`bench.checkpointing=true` under `strategy=model_parallel`, how long each way of writing
checkpoints holds training up (`checkpointing`).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ...console import remove_unused_run_dir
from ...errors import ConfigError
from ...run.settings import check_run_settings, check_whole
from ...targets import allow


@hydra.main(
    version_base="1.3",
    config_path="pkg://{{ cookiecutter.package_name }}.configs",
    config_name="bench",
)
def main(cfg: DictConfig) -> None:
    if (cfg.get("extras") or {}).get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    try:
        check_bench_settings(cfg)
        if cfg.bench.get("generation"):
            from .generation import bench_generation

            bench_generation(cfg)
{%- if cookiecutter.examples != "vision" %}
        elif cfg.bench.get("prepare"):
            from .preparation import bench_preparation

            bench_preparation(cfg)
{%- endif %}
        elif cfg.bench.get("checkpointing"):
            from .checkpointing import bench_checkpointing

            bench_checkpointing(cfg)
        else:
            from .training import bench

            bench(cfg)
    except ConfigError as error:
        remove_unused_run_dir()
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


def check_bench_settings(cfg: DictConfig) -> None:
    """The run's settings as train checks them, and the bench's own, before anything is built."""
    allow(cfg)
    check_run_settings(cfg)
    settings = cfg.bench
    check_whole("bench.warmup", settings.warmup, 1, allowed=())
    check_whole("bench.steps", settings.steps, 2, allowed=())
    check_whole("bench.matmul_size", settings.get("matmul_size"), 1)
{%- if cookiecutter.examples != "vision" %}
    if settings.get("peer") not in (None, "nanogpt"):
        raise ConfigError(
            f"bench.peer={settings.peer}: use nanogpt (a nanoGPT-style loop beside ours) or null."
        )
{%- endif %}
    for key in ("batch", "prompt_tokens", "new_tokens", "repeats", "save_every"):
        check_whole(f"bench.{key}", settings.get(key), 1, allowed=())
    if settings.get("checkpointing") and int(settings.save_every) > int(settings.steps):
        raise ConfigError(
            f"bench.save_every={settings.save_every} is more than bench.steps={settings.steps}: "
            "no checkpoint would be measured; lower it."
        )
    output = Path(str(settings.output)).expanduser()
    if output.is_dir():
        raise ConfigError(f"bench.output={settings.output} is a folder: give a file path.")
    if output.exists() and not output.is_file():
        raise ConfigError(
            f"bench.output={settings.output} is a device, a pipe or a socket, which the results "
            "would replace: give a file path."
        )
    above = next((folder for folder in output.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(
            f"bench.output={settings.output} is inside {above}, a file: give another file path."
        )
    if above is not None:
        try:
            with tempfile.TemporaryFile(dir=above):
                pass
        except OSError as error:
            raise ConfigError(
                f"bench.output={settings.output} cannot be written ({error.strerror} in "
                f"{above}): give a path in a folder you can write."
            ) from None


if __name__ == "__main__":
    main()
