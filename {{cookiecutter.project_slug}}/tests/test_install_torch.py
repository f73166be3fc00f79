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
