"""scripts/install_torch.py: a CUDA build only where a driver is, a CPU build or one line elsewhere."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "install_torch.py"


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
