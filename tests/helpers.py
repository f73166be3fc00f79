"""Baking the template and reading what it produced."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

TEMPLATE = Path(__file__).resolve().parents[1]
DEFAULTS = json.loads((TEMPLATE / "cookiecutter.json").read_text())
CHOICES = {
    key: value
    for key, value in DEFAULTS.items()
    if isinstance(value, list) and not key.startswith("_")
}
BINARY_SUFFIXES = {".gz"}
GITHUB_EXPRESSION = re.compile(r"\$\{\{.*?\}\}")


# The slowest tests of each baked project's own run, printed after the outer run's summary.
INNER_DURATIONS: list[str] = []


def answers_with(**overrides: str) -> dict[str, str]:
    """The answers cookiecutter would use: the first choice of each list, then the overrides."""
    answers = {key: value[0] for key, value in CHOICES.items()}
    answers.update(overrides)
    return answers


def text_files(project: Path) -> list[Path]:
    return [
        path
        for path in sorted(project.rglob("*"))
        if path.is_file() and path.suffix not in BINARY_SUFFIXES
    ]


def leftover_template_syntax(project: Path) -> list[str]:
    """Paths and lines where Jinja syntax survived rendering (GitHub's ${{ }} is allowed)."""
    found = []
    for path in sorted(project.rglob("*")):
        relative = str(path.relative_to(project))
        if "{{" in relative or "{%" in relative:
            found.append(relative)
    for path in text_files(project):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = GITHUB_EXPRESSION.sub("", line)
            if "{{" in line or "}}" in line or "{%" in line or "%}" in line:
                found.append(f"{path.relative_to(project)}:{number}: {line.strip()}")
    return found


def parse_structured_files(project: Path) -> dict[str, Any]:
    """Parse every TOML, YAML and JSON file; a parse error fails the caller."""
    parsed: dict[str, Any] = {}
    for path in text_files(project):
        text = path.read_text()
        relative = str(path.relative_to(project))
        if path.suffix == ".toml":
            parsed[relative] = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            parsed[relative] = yaml.safe_load(text)
        elif path.suffix == ".json":
            parsed[relative] = json.loads(text)
    return parsed


def expected_files(answers: dict[str, str], package: str) -> set[str]:
    """The exact file set a bake with these answers must produce."""
    src = f"src/{package}"
    configs = f"{src}/configs"
    files = {
        ".cookiecutter.json",
        ".gitignore",
        ".pre-commit-config.yaml",
        "Makefile",
        "README.md",
        "pyproject.toml",
        "scripts/install_torch.py",
        f"{src}/__init__.py",
        f"{src}/__main__.py",
        f"{src}/recipes/bench/__init__.py",
        f"{src}/recipes/bench/training.py",
        f"{src}/recipes/bench/clock.py",
        f"{src}/recipes/bench/device.py",
        f"{src}/recipes/bench/report.py",
        f"{src}/recipes/bench/generation.py",
        f"{src}/recipes/bench/checkpointing.py",
        f"{src}/recipes/predict.py",
        f"{src}/recipes/export.py",
        f"{src}/checkpointing/trained.py",
        f"{src}/memory/plan.py",
        f"{src}/memory/advice.py",
        f"{src}/models/lora.py",
        f"{src}/models/fp8.py",
        f"{configs}/predict.yaml",
        f"{configs}/export.yaml",
        f"{src}/cli.py",
        f"{src}/console.py",
        f"{src}/recipes/doctor.py",
        "docs/benchmarks.md",
        "docs/runs.md",
        "docs/configs.md",
        "docs/reliability.md",
        "docs/security.md",
        "docs/scaling.md",
        "docs/bigger-models.md",
        "docs/data.md",
        "docs/using-models.md",
        "docs/development.md",
        f"{src}/errors.py",
        f"{src}/files.py",
        f"{src}/recipes/evaluate.py",
        f"{src}/loggers.py",
        f"{src}/checkpointing/saving.py",
        f"{src}/checkpointing/sharded.py",
        f"{src}/checkpointing/differences.py",
        f"{src}/checkpointing/__init__.py",
        f"{src}/checkpointing/door/__init__.py",
        f"{src}/checkpointing/door/checkpoint.py",
        f"{src}/checkpointing/door/hugging_face_folder.py",
        f"{src}/checkpointing/door/shard_metadata.py",
        f"{src}/checkpointing/door/shards.py",
        f"{src}/checkpointing/door/single_file.py",
        f"{src}/recipes/__init__.py",
        f"{src}/run/__init__.py",
        f"{src}/run/checks.py",
        f"{src}/run/identity.py",
        f"{src}/run/start.py",
        f"{src}/memory/__init__.py",
        f"{src}/sweeps/__init__.py",
        f"{src}/run/names.py",
        f"{src}/run/record.py",
        f"{src}/run/machine.py",
        f"{src}/run/strategies.py",
        f"{src}/targets.py",
        f"{src}/sweeps/summary.py",
        f"{src}/sweeps/returns.py",
        f"{src}/sweeps/queued.py",
        f"{src}/run/other_ranks.py",
        f"{src}/recipes/train.py",
        f"{src}/run/steps.py",
        f"{src}/run/stop_signals.py",
        f"{src}/run/settings.py",
        f"{src}/run/plan.py",
        f"{src}/run/schedule.py",
        f"{src}/run/lock.py",
        f"{src}/command_errors.py",
        f"{src}/entry.py",
        f"{src}/sweeps/report.py",
        f"{src}/callbacks/optuna_pruning.py",
        f"src/hydra_plugins/{package}_optuna_sweeper/__init__.py",
        f"src/hydra_plugins/{package}_optuna_sweeper/_impl.py",
        f"src/hydra_plugins/{package}_optuna_sweeper/config.py",
        f"src/hydra_plugins/{package}_optuna_sweeper/optuna_sweeper.py",
        "scripts/torchrun.sh",
        "scripts/slurm.sbatch",
        f"{src}/callbacks/__init__.py",
        f"{src}/callbacks/exact_resume.py",
        f"{src}/callbacks/preemption.py",
        f"{src}/callbacks/step_checkpoint.py",
        f"{src}/callbacks/run_checkpoint.py",
        f"{src}/callbacks/monitored_metric.py",
        f"{src}/callbacks/model_summary.py",
        f"{src}/callbacks/non_finite.py",
        f"{src}/callbacks/run_config.py",
        f"{src}/callbacks/throughput.py",
        f"{src}/data/__init__.py",
        f"{src}/data/base.py",
        f"{src}/data/daemon_children.py",
        f"{src}/data/errors.py",
        f"{src}/data/folder_files.py",
        f"{src}/models/__init__.py",
        f"{src}/models/optim.py",
        f"{src}/models/step_logging.py",
        f"{src}/models/nets/__init__.py",
        f"{configs}/__init__.py",
        f"{configs}/schema.py",
        f"{configs}/train.yaml",
        f"{configs}/bench.yaml",
        f"{configs}/eval.yaml",
        f"{configs}/local/.gitkeep",
        f"{configs}/extras/default.yaml",
        f"{configs}/hydra/default.yaml",
        f"{configs}/paths/default.yaml",
        f"{configs}/logger/csv.yaml",
        f"{configs}/logger/none.yaml",
        f"{configs}/logger/wandb.yaml",
        f"{configs}/logger/tensorboard.yaml",
        f"{configs}/logger/mlflow.yaml",
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/faults.py",
        "tests/test_errors.py",
        "tests/fuzzing.py",
        "tests/test_fuzz_doors.py",
        "tests/test_file_reads.py",
        "tests/helpers.py",
        "tests/test_bench.py",
        "tests/test_configs.py",
        "tests/test_data_wait.py",
        "tests/test_doctor.py",
        "tests/test_resume.py",
        "tests/killing.py",
        "tests/warm_start.py",
        "tests/test_warm_start.py",
        "tests/test_kill_phases.py",
        "tests/test_kill_configs.py",
        "tests/test_stop_signals.py",
        "tests/test_targets.py",
        "tests/test_package_layers.py",
        "tests/test_runs.py",
        "tests/test_run_plan.py",
        "tests/test_schedulers.py",
        "tests/test_scale_out.py",
        "tests/test_sweep_failures.py",
        "tests/test_command_line.py",
        "tests/test_install_torch.py",
        "tests/test_slurm.py",
        "scripts/local_slurm.py",
        "sweeps/wandb.yaml",
        "tests/test_trackers.py",
        "docs/tracking.md",
        f"src/hydra_plugins/{package}_slurm_launcher/__init__.py",
        f"src/hydra_plugins/{package}_slurm_launcher/launcher.py",
        f"src/hydra_plugins/{package}_slurm_launcher/_jobs.py",
        f"{src}/recipes/serve/__init__.py",
        f"{src}/recipes/serve/__main__.py",
        f"{src}/recipes/serve/app.py",
        f"{src}/recipes/serve/batching.py",
        f"{src}/recipes/serve/classification.py",
        f"{src}/recipes/serve/errors.py",
        f"{src}/recipes/serve/generation.py",
        f"{src}/recipes/serve/openai.py",
        f"{src}/recipes/serve/server.py",
        f"{src}/recipes/serve/settings.py",
        f"{configs}/serve.yaml",
        f"{src}/run/parent_death.py",
        "deploy/kubernetes/pytorchjob.yaml",
        "deploy/kubernetes/runs-volume.yaml",
        "deploy/skypilot/train.yaml",
        "tests/skypilot_schemas.yaml",
        "tests/test_deploy_manifests.py",
        "tests/test_optuna_faults.py",
        "tests/test_serve.py",
        "tests/test_slurm_faults.py",
        "tests/test_slurm_sweeps.py",
        "tests/test_torchrun_faults.py",
    }
    files |= {
        f"{configs}/strategy/{name}.yaml"
        for name in ("auto", "ddp", "ddp_spawn", "fsdp", "model_parallel")
    }
    files |= {f"{configs}/hydra/launcher/{name}.yaml" for name in ("local_gpus", "slurm")}
    files |= {f"{configs}/trainer/{name}.yaml" for name in ("default", "cpu", "gpu", "mps")}
    files |= {
        f"{configs}/debug/{name}.yaml"
        for name in ("default", "fdr", "overfit", "limit", "profiler")
    }
    files |= {
        f"{configs}/scheduler/{name}.yaml"
        for name in ("constant", "cosine", "onecycle", "plateau", "step")
    }
    files |= {
        f"{configs}/callbacks/{name}.yaml"
        for name in (
            "default",
            "none",
            "model_checkpoint",
            "last_checkpoint",
            "step_checkpoint",
            "preemption",
            "non_finite",
            "early_stopping",
            "lr_monitor",
            "progress_bar",
            "model_summary",
            "throughput",
        )
    }
    if answers["examples"] in ("both", "vision"):
        files |= {
            f"{src}/data/digits.py",
            f"{src}/data/mnist.py",
            f"{src}/data/assets/digits.csv.gz",
            f"{src}/data/assets/DIGITS_LICENSE.md",
            f"{src}/models/image_classifier.py",
            f"{src}/models/nets/convnet.py",
            f"{configs}/data/digits.yaml",
            f"{configs}/data/mnist.yaml",
            f"{configs}/model/digits_convnet.yaml",
            f"{configs}/model/mnist_convnet.yaml",
            f"{configs}/experiment/digits.yaml",
            f"{configs}/experiment/mnist.yaml",
            f"{configs}/hparams_search/digits_optuna.yaml",
            "tests/test_vision.py",
            "tests/test_use_vision.py",
            f"{src}/data/image_files.py",
            f"{src}/data/image_folder.py",
            f"{configs}/data/image_folder.yaml",
            f"{src}/models/nets/backbones.py",
            f"{src}/checkpointing/hugging_face_images.py",
            f"{src}/checkpointing/timm_backbones.py",
            f"{configs}/model/backbone_classifier.yaml",
            f"{configs}/model/backbone/hugging_face.yaml",
            f"{configs}/model/backbone/timm.yaml",
            f"{configs}/experiment/image_folder_pretrained.yaml",
            "tests/test_backbones.py",
            "tests/test_fuzz_vision_doors.py",
            f"{configs}/experiment/image_folder.yaml",
            "tests/test_image_folder.py",
        }
    if answers["examples"] in ("both", "language"):
        files |= {
            f"{src}/data/text.py",
            f"{src}/models/language_model.py",
            f"{src}/models/nets/gpt.py",
            f"{src}/models/nets/decoding.py",
            f"{src}/models/nets/llama.py",
            f"{src}/checkpointing/hugging_face_decoders.py",
            f"{configs}/model/llama_tiny.yaml",
            f"{configs}/model/smollm2_135m.yaml",
            f"{configs}/model/qwen2_5_0_5b.yaml",
            f"{configs}/experiment/language_llama.yaml",
            f"{configs}/experiment/smollm2_instruct.yaml",
            f"{configs}/experiment/smollm2_instruct_lora.yaml",
            f"{configs}/experiment/qwen2_5_instruct_lora.yaml",
            "tests/test_llama_family.py",
            "tests/test_fuzz_language_doors.py",
            f"{src}/models/losses.py",
            f"{src}/recipes/bench/peer.py",
            f"{src}/recipes/serve/continuous.py",
            "tests/test_chunked_loss.py",
            "tests/test_compiled_decode.py",
            "scripts/serve_against_plain.py",
            f"{configs}/data/stdlib_text.yaml",
            f"{configs}/model/gpt_tiny.yaml",
            f"{configs}/model/gpt2_small.yaml",
            f"{configs}/experiment/language.yaml",
            f"{configs}/experiment/gpt2_small.yaml",
            f"{configs}/hparams_search/language_optuna.yaml",
            "tests/test_language.py",
            "tests/test_use_language.py",
            "tests/test_memory_plan.py",
            "tests/test_fp8.py",
            "tests/test_sharded_checkpoints.py",
            "tests/test_token_shards.py",
            "tests/test_streaming.py",
            f"{src}/data/tokenizer.py",
            f"{src}/data/token_shards.py",
            f"{src}/data/streaming.py",
            f"{src}/recipes/prepare/__init__.py",
            f"{src}/recipes/prepare/__main__.py",
            f"{src}/recipes/prepare/corpus_pieces.py",
            f"{src}/recipes/prepare/shards.py",
            f"{configs}/prepare.yaml",
            f"{configs}/data/token_shards.yaml",
            f"{configs}/experiment/language_bpe.yaml",
            f"{configs}/experiment/gpt2_small_bpe.yaml",
            f"{configs}/experiment/language_finetune.yaml",
            f"{configs}/experiment/gpt2_medium.yaml",
            f"{configs}/experiment/gpt_1b.yaml",
            f"{configs}/model/gpt2_medium.yaml",
            f"{configs}/model/gpt_1b.yaml",
            f"{src}/checkpointing/hugging_face.py",
            f"{src}/data/tokenized_text.py",
            f"{configs}/data/tokenized_text.yaml",
            f"{configs}/experiment/gpt2_pretrained.yaml",
            f"{configs}/experiment/gpt2_instruct.yaml",
            f"{configs}/model/gpt2_pretrained.yaml",
            "tests/test_pretrained.py",
            f"{src}/data/corpus.py",
            f"{src}/data/shard_format.py",
            f"{src}/data/tokenizing.py",
            f"{src}/data/tokenizing_worker.py",
            f"{src}/recipes/bench/plain_prepare.py",
            f"{src}/recipes/bench/preparation.py",
            "tests/test_prepare_speed.py",
            f"{src}/data/instructions.py",
            f"{src}/data/chat_template.py",
            f"{src}/data/assets/toy_instructions.jsonl",
            f"{configs}/data/instructions.yaml",
            f"{configs}/experiment/instruct.yaml",
            f"{configs}/experiment/instruct_lora.yaml",
            "tests/test_instructions.py",
        }
    if answers["github_actions"] == "yes":
        files.add(".github/workflows/ci.yaml")
    if answers["dockerfile"] == "yes":
        files |= {"Dockerfile", ".dockerignore"}
    if answers["license"] != "none":
        files.add("LICENSE")
    return files


def project_files(project: Path) -> set[str]:
    return {
        str(path.relative_to(project))
        for path in project.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a baked project's own tools: this venv's tools, none of the outer
    pytest's plugins, options or paths."""
    leaks = ("PYTEST_", "COV_CORE_", "PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
    env = {key: value for key, value in os.environ.items() if not key.startswith(leaks)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env.update(extra)
    return env


def run(
    command: list[str], cwd: Path, timeout: int = 3300, **env: str
) -> subprocess.CompletedProcess[str]:
    """A step of a baked project (the longest: its slow suite, about 30 minutes on two cores;
    the bound leaves room for a slower machine, within CI's 90 minutes)."""
    return subprocess.run(
        command,
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
