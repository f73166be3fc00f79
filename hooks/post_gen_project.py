"""Remove what the answers did not choose, then print the next steps.

Every step tolerates a file that is already gone, so the hook can run again (cruft re-runs it on
`cruft diff` and `cruft update`). It never reads a terminal, never uses the network, never runs git.
"""

import json
import shutil
import sys
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")

PROJECT = Path.cwd()
PACKAGE = Path("src") / ANSWERS["package_name"]
CONFIGS = PACKAGE / "configs"

VISION_FILES = [
    PACKAGE / "data" / "digits.py",
    PACKAGE / "data" / "mnist.py",
    PACKAGE / "data" / "assets" / "digits.csv.gz",
    PACKAGE / "data" / "assets" / "DIGITS_LICENSE.md",
    PACKAGE / "models" / "image_classifier.py",
    PACKAGE / "models" / "nets" / "convnet.py",
    CONFIGS / "data" / "digits.yaml",
    CONFIGS / "data" / "mnist.yaml",
    CONFIGS / "model" / "digits_convnet.yaml",
    CONFIGS / "model" / "mnist_convnet.yaml",
    CONFIGS / "experiment" / "digits.yaml",
    CONFIGS / "experiment" / "mnist.yaml",
    CONFIGS / "hparams_search" / "digits_optuna.yaml",
    Path("tests") / "test_vision.py",
    Path("tests") / "test_use_vision.py",
    PACKAGE / "data" / "image_files.py",
    PACKAGE / "data" / "image_folder.py",
    CONFIGS / "data" / "image_folder.yaml",
    CONFIGS / "experiment" / "image_folder.yaml",
    Path("tests") / "test_image_folder.py",
    PACKAGE / "models" / "nets" / "backbones.py",
    PACKAGE / "checkpointing" / "hugging_face_images.py",
    PACKAGE / "checkpointing" / "timm_backbones.py",
    CONFIGS / "model" / "backbone_classifier.yaml",
    CONFIGS / "model" / "backbone",
    CONFIGS / "experiment" / "image_folder_pretrained.yaml",
    Path("tests") / "test_backbones.py",
    Path("tests") / "test_fuzz_vision_doors.py",
]
LANGUAGE_FILES = [
    PACKAGE / "data" / "text.py",
    PACKAGE / "models" / "language_model.py",
    PACKAGE / "models" / "nets" / "gpt.py",
    PACKAGE / "models" / "nets" / "decoding.py",
    PACKAGE / "models" / "nets" / "llama.py",
    PACKAGE / "checkpointing" / "hugging_face_decoders.py",
    CONFIGS / "model" / "llama_tiny.yaml",
    CONFIGS / "model" / "smollm2_135m.yaml",
    CONFIGS / "model" / "qwen2_5_0_5b.yaml",
    CONFIGS / "experiment" / "language_llama.yaml",
    CONFIGS / "experiment" / "smollm2_instruct.yaml",
    CONFIGS / "experiment" / "smollm2_instruct_lora.yaml",
    CONFIGS / "experiment" / "qwen2_5_instruct_lora.yaml",
    Path("tests") / "test_llama_family.py",
    Path("tests") / "test_fuzz_language_doors.py",
    PACKAGE / "models" / "losses.py",
    PACKAGE / "recipes" / "bench" / "peer.py",
    PACKAGE / "recipes" / "serve" / "continuous.py",
    Path("tests") / "test_chunked_loss.py",
    Path("tests") / "test_compiled_decode.py",
    Path("scripts") / "serve_against_plain.py",
    CONFIGS / "data" / "stdlib_text.yaml",
    CONFIGS / "model" / "gpt_tiny.yaml",
    CONFIGS / "model" / "gpt2_small.yaml",
    CONFIGS / "model" / "gpt2_medium.yaml",
    CONFIGS / "model" / "gpt_1b.yaml",
    CONFIGS / "experiment" / "language.yaml",
    CONFIGS / "experiment" / "gpt2_small.yaml",
    CONFIGS / "experiment" / "gpt2_medium.yaml",
    CONFIGS / "experiment" / "gpt_1b.yaml",
    CONFIGS / "experiment" / "language_finetune.yaml",
    CONFIGS / "hparams_search" / "language_optuna.yaml",
    Path("tests") / "test_language.py",
    Path("tests") / "test_use_language.py",
    Path("tests") / "test_memory_plan.py",
    Path("tests") / "test_fp8.py",
    Path("tests") / "test_sharded_checkpoints.py",
    Path("tests") / "test_token_shards.py",
    Path("tests") / "test_streaming.py",
    PACKAGE / "data" / "tokenizer.py",
    PACKAGE / "data" / "token_shards.py",
    PACKAGE / "data" / "streaming.py",
    PACKAGE / "recipes" / "prepare",
    PACKAGE / "data" / "corpus.py",
    PACKAGE / "data" / "shard_format.py",
    PACKAGE / "data" / "tokenizing.py",
    PACKAGE / "data" / "tokenizing_worker.py",
    PACKAGE / "recipes" / "bench" / "preparation.py",
    PACKAGE / "recipes" / "bench" / "plain_prepare.py",
    Path("tests") / "test_prepare_speed.py",
    CONFIGS / "prepare.yaml",
    CONFIGS / "data" / "token_shards.yaml",
    CONFIGS / "experiment" / "language_bpe.yaml",
    CONFIGS / "experiment" / "gpt2_small_bpe.yaml",
    PACKAGE / "checkpointing" / "hugging_face.py",
    PACKAGE / "data" / "tokenized_text.py",
    CONFIGS / "data" / "tokenized_text.yaml",
    CONFIGS / "model" / "gpt2_pretrained.yaml",
    CONFIGS / "experiment" / "gpt2_pretrained.yaml",
    CONFIGS / "experiment" / "gpt2_instruct.yaml",
    Path("tests") / "test_pretrained.py",
    PACKAGE / "data" / "instructions.py",
    PACKAGE / "data" / "chat_template.py",
    PACKAGE / "data" / "assets" / "toy_instructions.jsonl",
    CONFIGS / "data" / "instructions.yaml",
    CONFIGS / "experiment" / "instruct.yaml",
    CONFIGS / "experiment" / "instruct_lora.yaml",
    Path("tests") / "test_instructions.py",
]
# Every logger's config stays in every bake (logger=mlflow works in a wandb project once its
# package is installed): the logger answer only picks train.yaml's default and the dependency.
GITHUB_FILES = [Path(".github")]
DOCKER_FILES = [Path("Dockerfile"), Path(".dockerignore")]
LICENSE_FILES = [Path("LICENSE")]


def remove(relative: Path) -> None:
    path = PROJECT / relative
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def unchosen_files(answers: dict) -> list[Path]:
    paths: list[Path] = []
    if answers["examples"] == "language":
        paths += VISION_FILES
    if answers["examples"] == "vision":
        paths += LANGUAGE_FILES
    if answers["github_actions"] != "yes":
        paths += GITHUB_FILES
    if answers["dockerfile"] != "yes":
        paths += DOCKER_FILES
    if answers["license"] == "none":
        paths += LICENSE_FILES
    return paths


def next_steps(answers: dict) -> str:
    package = answers["package_name"]
    slug = answers["project_slug"]
    return "\n".join(
        [
            "",
            f"Created {slug}. Next steps:",
            f"  cd {slug}",
            "  python -m venv .venv && . .venv/bin/activate",
            "  make install          # CPU torch wheel if no GPU, then the project and its dev tools",
            f"  {package}-train       # train the default experiment on its bundled data",
            "  make test             # the project's own tests",
            "",
        ]
    )


def main() -> int:
    for path in unchosen_files(ANSWERS):
        remove(path)
    print(next_steps(ANSWERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
