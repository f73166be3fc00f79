"""scripts/install_torch.py: a CUDA build only where a driver is, a CPU build or one line elsewhere."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PROJECT = Path(__file__).parents[1]
SCRIPT = PROJECT / "scripts" / "install_torch.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(version: str, needs: list[str]) -> dict[str, Any]:
    metadata = {"version": version, "requires_dist": needs}
    return {"metadata": metadata}


CUDA_WHEEL = report(
    "2.13.0", ["filelock", "nvidia-cublas-cu12==12.8.4.1; platform_system == 'Linux'"]
)
CPU_WHEEL = report("2.13.0+cpu", ["filelock"])

MACHINES = {
    # name: (driver, CPU index reachable, what the configured index offers, exit code, index used)
    "driver": (True, False, CUDA_WHEEL, 0, "configured"),
    "no driver, CPU index reachable": (False, True, CUDA_WHEEL, 0, "cpu"),
    "no driver, offline, CPU wheel offered": (False, False, CPU_WHEEL, 0, "configured"),
    "no driver, offline, CUDA wheel offered": (False, False, CUDA_WHEEL, 1, None),
    "no driver, offline, nothing resolves": (False, False, None, 1, None),
}  # fmt: skip


@pytest.mark.parametrize("machine", list(MACHINES))
def test_torch_is_chosen_for_the_machine(
    machine: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    driver, reachable, offer, code, index = MACHINES[machine]
    script = load_script()
    calls: list[list[str]] = []
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        script.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if driver else None
    )
    monkeypatch.setattr(script, "reachable", lambda url: reachable)
    monkeypatch.setattr(script, "offered", lambda requirement: offer)
    monkeypatch.setattr(script.subprocess, "call", lambda command: calls.append(command) or 0)
    monkeypatch.delenv("TORCH_CUDA", raising=False)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "torch==2.13.0"])
    assert script.main() == code
    if index is None:
        assert calls == [], "nothing installed"
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and "TORCH_INDEX_URL" in line and "TORCH_CUDA=1" in line
        return
    (command,) = calls
    assert command[-1 if index == "configured" else 4] == "torch==2.13.0"
    assert ("--index-url" in command) == (index == "cpu")


def test_an_installed_torch_is_kept(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0 and "keeping it" in result.stdout


def test_a_cuda_build_is_recognised_from_its_metadata() -> None:
    script = load_script()
    assert script.is_cuda_build(CUDA_WHEEL)
    assert script.is_cuda_build(report("2.13.0+cu128", []))
    assert not script.is_cuda_build(CPU_WHEEL)


def makefile_torch() -> str:
    """The torch requirement that `make install` passes to the script (the Makefile's TORCH)."""
    (pin,) = re.findall(r"^TORCH \?= (\S+)$", (PROJECT / "Makefile").read_text(), re.MULTILINE)
    return str(pin)


def test_make_install_pins_the_tested_torch_within_what_pyproject_allows() -> None:
    """`make install` installs the torch the template's `make demo` installs (2.13.0, the
    script's TESTED), which pyproject.toml's own requirement (torch>=2.6) admits."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    pin = makefile_torch()
    assert pin == load_script().TESTED == "torch==2.13.0"
    exact = re.fullmatch(r"torch==(\d+\.\d+\.\d+)", pin)
    assert exact, "one exact version"
    version = exact.group(1)
    pyproject = (PROJECT / "pyproject.toml").read_text()
    (needed,) = [Requirement(r) for r in re.findall(r'"(torch[<>=!~][^"]*)"', pyproject)]
    assert needed.specifier.contains(version) and Version(version) <= Version("2.14.1")


FAILURES = {
    # name: (driver, CPU index reachable, what the configured index offers, pip's exit code)
    "driver, pip fails": (True, False, CUDA_WHEEL, 1),
    "no driver, CPU index reachable, pip fails": (False, True, CUDA_WHEEL, 1),
    "no driver, offline, CPU wheel offered, pip fails": (False, False, CPU_WHEEL, 1),
    "no driver, offline, nothing resolves": (False, False, None, 0),
}  # fmt: skip


@pytest.mark.parametrize("machine", list(FAILURES))
@pytest.mark.parametrize("asked", ["torch==2.5.1", "torch"])
def test_an_install_that_fails_names_the_tested_torch_as_the_fix(
    machine: str, asked: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    driver, reachable, offer, pip_code = FAILURES[machine]
    script = load_script()
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        script.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if driver else None
    )
    monkeypatch.setattr(script, "reachable", lambda url: reachable)
    monkeypatch.setattr(script, "offered", lambda requirement: offer)
    monkeypatch.setattr(script.subprocess, "call", lambda command: pip_code)
    monkeypatch.delenv("TORCH_CUDA", raising=False)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", asked])
    assert script.main() == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and asked in line
    assert f"make install TORCH={makefile_torch()}" in line, line


def test_when_the_tested_torch_fails_the_newest_is_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = load_script()
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(script.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(script.subprocess, "call", lambda command: 1)
    monkeypatch.setattr(sys, "argv", ["install_torch.py"])  # as the Dockerfile runs it
    assert script.main() == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert script.TESTED in line and "make install TORCH=torch " in line, line


@pytest.mark.parametrize(
    ("torch", "torchvision"),
    [
        ("torch==2.13.0", "torchvision==0.28.*"),
        ("2.13.0+cpu", "torchvision==0.28.*"),
        ("2.14.1", "torchvision==0.29.*"),
        ("torch==2.6.0", "torchvision==0.21.*"),
        ("2.9.1+cu128", "torchvision==0.24.*"),
        ("torch", "torchvision"),
        ("torch>=2.6", "torchvision"),
        (None, "torchvision"),
    ],
)
def test_torchvision_is_the_release_made_for_the_torch(torch: str | None, torchvision: str) -> None:
    assert load_script().torchvision_requirement(torch) == torchvision


def vision_machine(
    monkeypatch: pytest.MonkeyPatch,
    torch_installed: str | None,
    works: bool = True,
    reachable: bool = True,
) -> tuple[ModuleType, list[list[str]]]:
    """The script on a machine without a driver, pip mocked; torch_installed: the installed
    torch's version, or None."""
    script = load_script()
    calls: list[list[str]] = []
    versions = {"torch": torch_installed or "2.13.0+cpu", "torchvision": "0.28.0+cpu"}
    monkeypatch.setattr(
        script.importlib.util, "find_spec", lambda name: object() if torch_installed else None
    )
    monkeypatch.setattr(script, "installed_version", lambda name: versions[name])
    monkeypatch.setattr(script.shutil, "which", lambda name: None)
    monkeypatch.setattr(script, "reachable", lambda url: reachable)
    monkeypatch.setattr(script, "offered", lambda requirement: CPU_WHEEL)
    monkeypatch.setattr(script.subprocess, "call", lambda command: calls.append(command) or 0)
    monkeypatch.setattr(
        script, "torchvision_failure", lambda: None if works else "operator nms does not exist"
    )
    monkeypatch.delenv("TORCH_CUDA", raising=False)
    return script, calls


def test_vision_installs_the_pair_in_one_command_from_the_cpu_index_then_timm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script, calls = vision_machine(monkeypatch, torch_installed=None)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "torch==2.13.0", "--vision"])
    assert script.main() == 0
    pair, timm = calls
    assert {"torch==2.13.0", "torchvision==0.28.*"} <= set(pair)
    assert pair[pair.index("--index-url") + 1] == script.CPU_INDEX
    assert timm[4:] == ["timm>=1.0", "torch==2.13.0+cpu", "torchvision==0.28.0+cpu"]


def test_vision_offline_takes_the_pair_from_the_configured_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script, calls = vision_machine(monkeypatch, torch_installed=None, reachable=False)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "--vision"])
    assert script.main() == 0
    pair, _ = calls
    assert pair[4:] == [script.TESTED, "torchvision==0.28.*"] and "--index-url" not in pair


@pytest.mark.parametrize(
    ("torch", "index"),
    [("2.13.0+cpu", "https://download.pytorch.org/whl/cpu"), ("2.13.0", None),
     ("2.14.1+cu128", "https://download.pytorch.org/whl/cu128")],
)  # fmt: skip
def test_vision_beside_an_installed_torch_holds_it_and_uses_its_builds_index(
    torch: str, index: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    script, calls = vision_machine(monkeypatch, torch_installed=torch)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "torch==2.13.0", "--vision"])
    assert script.main() == 0
    pair, timm = calls
    minor = int(torch.split(".")[1]) + 15
    assert pair[4:6] == [f"torchvision==0.{minor}.*", f"torch=={torch}"]
    assert (pair[pair.index("--index-url") + 1] if "--index-url" in pair else None) == index
    assert f"torch=={torch}" in timm


def test_a_torchvision_that_does_not_import_is_uninstalled_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script, calls = vision_machine(monkeypatch, torch_installed="2.13.0+cpu", works=False)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "--vision"])
    assert script.main() == 1
    assert calls[-1][-3:] == ["uninstall", "--yes", "torchvision"], "and no timm"
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "model/backbone=hugging_face" in line


def test_without_vision_no_torchvision_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    script, calls = vision_machine(monkeypatch, torch_installed=None)
    monkeypatch.setattr(sys, "argv", ["install_torch.py", "torch==2.13.0"])
    assert script.main() == 0
    (command,) = calls
    assert not [part for part in command if "torchvision" in part or "timm" in part]


def test_make_install_passes_vision_on() -> None:
    """`make install VISION=1` runs the script with --vision."""
    makefile = (PROJECT / "Makefile").read_text()
    assert "$(if $(VISION),--vision)" in makefile
