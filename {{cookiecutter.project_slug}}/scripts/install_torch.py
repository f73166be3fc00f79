"""Install torch for this machine, before the project: a CUDA build where an NVIDIA driver is
present, a CPU-only build otherwise (a few hundred MB instead of several GB).

    python scripts/install_torch.py [requirement]     # default: TESTED, the Makefile's TORCH

An installed torch is kept. Without a driver, the CPU build comes from PyTorch's CPU wheel index
(or TORCH_INDEX_URL, e.g. a mirror of it); where that cannot be reached, from the configured
package index if what it offers is a CPU build. A CUDA build is never installed on a machine
without a driver unless TORCH_CUDA=1 asks for it: the script stops with one line saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

CPU_INDEX = os.environ.get("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
# The torch this project is tested with, which `make install` installs (the Makefile's TORCH, the
# same as the template's `make demo`); pyproject.toml accepts any torch from 2.6 on.
TESTED = "torch==2.13.0"


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except (OSError, ValueError):
        return False


def offered(requirement: str) -> dict[str, object] | None:
    """What `pip install requirement` would install from the configured index (resolved, not
    installed), or None where pip cannot resolve it."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        resolved = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet",
             "--ignore-installed", "--report", str(report), requirement],
            capture_output=True, text=True,
        )  # fmt: skip
        if resolved.returncode != 0 or not report.is_file():
            return None
        found = json.loads(report.read_text()).get("install", [])
    return dict(found[0]) if found else None


def is_cuda_build(install: dict[str, object]) -> bool:
    metadata = dict(install.get("metadata") or {})  # type: ignore[call-overload]
    version = str(metadata.get("version", ""))
    needs = " ".join(str(r) for r in metadata.get("requires_dist") or [])
    return "+cu" in version or "nvidia-" in needs


def other_version(requirement: str) -> str:
    """The fix that names another torch: the tested one, or, where that was asked for, the
    newest that pip finds for this Python."""
    if requirement != TESTED:
        return f"make install TORCH={TESTED} (the version this project is tested with)"
    return "make install TORCH=torch (the newest for this Python; any from 2.6 on works)"


def installed(command: list[str], requirement: str) -> int:
    """Run pip; where it fails, one line saying what to try."""
    code = subprocess.call(command)
    if code != 0:
        print(
            f"error: pip could not install {requirement} (its output is above). Try "
            f"{other_version(requirement)}.",
            file=sys.stderr,
        )
    return code


def main() -> int:
    requirement = sys.argv[1] if len(sys.argv) > 1 else TESTED
    if importlib.util.find_spec("torch") is not None:
        print("torch is already installed; keeping it.")
        return 0
    command = [sys.executable, "-m", "pip", "install", requirement]
    if shutil.which("nvidia-smi") or os.environ.get("TORCH_CUDA") == "1":
        print(f"NVIDIA driver found (or TORCH_CUDA=1): installing {requirement} with CUDA.")
        return installed(command, requirement)
    if reachable(CPU_INDEX.rstrip("/") + "/"):
        print(f"No NVIDIA driver: installing {requirement} from the CPU-only index {CPU_INDEX}.")
        return installed(
            [*command, "--index-url", CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"],
            requirement,
        )
    install = offered(requirement)
    if install is not None and not is_cuda_build(install):
        version = dict(install.get("metadata") or {}).get("version")  # type: ignore[call-overload]
        print(f"No NVIDIA driver: installing torch {version}, a CPU build, from the package index.")
        return installed(command, requirement)
    if install is None:  # another version may resolve
        what, fix = f"no {requirement} that pip can resolve", f", try {other_version(requirement)}"
    else:
        what, fix = "a CUDA build (several GB)", ""
    print(
        f"error: this machine has no NVIDIA driver, {CPU_INDEX} cannot be reached, and the package "
        f"index offers {what}. Set TORCH_INDEX_URL to a CPU wheel index (or a mirror of it), "
        f"install a CPU build of torch first (it is kept){fix}, or set TORCH_CUDA=1 to install the "
        "CUDA build anyway.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
