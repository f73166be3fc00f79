"""`{{ cookiecutter.package_name }}-bench`: measure an experiment on this machine.

    {{ cookiecutter.package_name }}-bench{% if cookiecutter.examples != "vision" %} experiment=gpt2_small trainer=gpu{% endif %} bench.steps=50
{%- if cookiecutter.examples != "vision" %}
    {{ cookiecutter.package_name }}-bench experiment=language bench.generation=true
{%- endif %}

By default it times the training step, in Lightning and in plain PyTorch (`training`); with
`bench.generation=true`, a language model's generation speed with and without its key/value
cache (`generation`); with `bench.checkpointing=true` under `strategy=model_parallel`, how long
each way of writing checkpoints holds training up (`checkpointing`).
"""

from __future__ import annotations

import sys
import warnings

import hydra
from omegaconf import DictConfig

# Importing cli installs what every console script has: Hydra's errors in one line, the
# `_target_` check of `hydra.callbacks`, the run-name resolver.
from ..cli import remove_unused_run_dir
from ..errors import ConfigError


@hydra.main(
    version_base="1.3",
    config_path="pkg://{{ cookiecutter.package_name }}.configs",
    config_name="bench",
)
def main(cfg: DictConfig) -> None:
    if (cfg.get("extras") or {}).get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    try:
        if cfg.bench.get("generation"):
            from .generation import bench_generation

            bench_generation(cfg)
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


if __name__ == "__main__":
    main()
