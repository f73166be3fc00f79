"""The generated Dockerfile parses with Docker's own parser (buildkit's, through the `dockerfile`
package), installs the project with the steps the README shows, and copies everything that
install needs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest
from cookiecutter.main import cookiecutter

from .helpers import TEMPLATE, run

INSTRUCTIONS = {
    "ADD",
    "ARG",
    "CMD",
    "COPY",
    "ENTRYPOINT",
    "ENV",
    "EXPOSE",
    "FROM",
    "HEALTHCHECK",
    "LABEL",
    "ONBUILD",
    "RUN",
    "SHELL",
    "STOPSIGNAL",
    "USER",
    "VOLUME",
    "WORKDIR",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("docker")
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output)))


def instructions(project: Path, name: str) -> list[dockerfile.Command]:
    return [c for c in dockerfile.parse_file(str(project / "Dockerfile")) if c.cmd == name]


def shell_commands(project: Path) -> list[str]:
    return [
        part.strip()
        for command in instructions(project, "RUN")
        for part in command.value[0].split("&&")
    ]


def readme_docker_commands(project: Path) -> list[str]:
    section = (project / "README.md").read_text().split("## Docker", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [
        part.strip()
        for block in blocks
        for line in block.splitlines()
        for part in line.split("&&")
        if part.strip()
    ]


def test_dockerfile_parses_with_known_instructions_only(project: Path) -> None:
    """A typo'd instruction (which buildkit's parser accepts and `docker build` rejects) fails."""
    commands = dockerfile.parse_file(str(project / "Dockerfile"))
    assert [c.cmd for c in commands if c.cmd not in INSTRUCTIONS] == []
    assert commands[0].cmd == "FROM"
    assert commands[0].value[0].startswith(("pytorch/pytorch:", "nvidia/cuda:"))


def test_image_runs_the_train_command(project: Path) -> None:
    (entrypoint,) = instructions(project, "ENTRYPOINT")
    package = next((project / "src").glob("*/cli.py")).parent.name
    assert entrypoint.json and entrypoint.value == (f"{package}-train",)
    assert f'{package}-train = "{package}.entry:train"' in (project / "pyproject.toml").read_text()


def test_install_steps_are_the_ones_the_readme_shows(project: Path) -> None:
    steps = shell_commands(project)
    assert steps == ["python scripts/install_torch.py", "python -m pip install ."]
    assert all(step in readme_docker_commands(project) for step in steps)
    makefile_install = (project / "Makefile").read_text().split("\ninstall:", 1)[1].split("\n\n")[0]
    assert "python scripts/install_torch.py" in makefile_install
    assert "python -m pip install -e" in makefile_install


def test_copied_files_are_enough_to_run_the_install_steps(project: Path, tmp_path: Path) -> None:
    """Run the image's install steps in a folder holding only what the Dockerfile copies (torch is
    already installed here, as in the image); a wheel is built instead of installed, without
    dependencies, so this venv is left alone."""
    context = tmp_path / "workspace"
    context.mkdir()
    for copy in instructions(project, "COPY"):
        *sources, destination = copy.value
        for source in sources:
            if (project / source).is_dir():  # Docker copies a folder's contents to the target
                shutil.copytree(project / source, context / destination, dirs_exist_ok=True)
            else:
                target = context / destination
                target = target / Path(source).name if destination.endswith("/") else target
                shutil.copy2(project / source, target)
    ignored = (project / ".dockerignore").read_text().split()
    assert not any(Path(p).parts[0] in ignored for p in ("src", "scripts", "pyproject.toml"))

    install_torch, pip_install = shell_commands(project)
    torch_step = run([sys.executable, *install_torch.split()[1:]], context)
    assert torch_step.returncode == 0, torch_step.stderr
    assert "keeping it" in torch_step.stdout
    assert pip_install.endswith("pip install .")
    wheel = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            "dist",
            ".",
        ],
        context,
    )
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    (built,) = (context / "dist").glob("*.whl")
    listing = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(built)], capture_output=True, text=True
    ).stdout
    assert "configs/train.yaml" in listing and "data/assets/digits.csv.gz" in listing
