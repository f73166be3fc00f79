"""Install torch for this machine, before the project: a CUDA build where an NVIDIA driver is
present, a CPU-only build otherwise (a few hundred MB instead of several GB).

    python scripts/install_torch.py [requirement]     # default: TESTED, the Makefile's TORCH
    python scripts/install_torch.py [requirement] --vision   # also torchvision and timm

An installed torch is kept. Without a driver, the CPU build comes from PyTorch's CPU wheel index
(or TORCH_INDEX_URL, e.g. a mirror of it); where that cannot be reached, from the configured
package index if what it offers is a CPU build. A CUDA build is never installed on a machine
without a driver unless TORCH_CUDA=1 asks for it: the script stops with one line saying so.

With --vision (`make install VISION=1`), torchvision is installed in the same pip command as
torch, from the same index, as the release made for that torch (torch 2.13.0: torchvision 0.28),
so that pip never swaps torch for another to satisfy it; beside an installed torch, the release
made for it, from the index of its build (+cpu: the CPU index). Then timm, with both held where
they are. A torchvision built for another torch fails as it imports ("operator torchvision::nms
does not exist"), which is what this avoids.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
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


TIMM = "timm>=1.0"
# torchvision's minor version is torch's plus 15 for every torch 2 release from 2.1 on (torch
# 2.6: torchvision 0.21, torch 2.13: 0.28).
TORCHVISION_MINOR_OFFSET = 15


def torchvision_requirement(torch_version: str | None) -> str:
    """The torchvision made for a torch (`2.13.0`, `2.13.0+cpu`, `torch==2.13.0`): every patch
    release of its minor version, which pip narrows to the one that requires that torch when
    both are in one command. Any other requirement (none, `torch`, `torch>=2.6`): torchvision
    unpinned, which pip resolves together with torch in the same command."""
    version = (torch_version or "").removeprefix("torch==")
    found = re.fullmatch(r"2\.(\d+)(?:\.\d+)?(?:\+[\w.]+)?", version)
    if found is None or int(found.group(1)) < 1:
        return "torchvision"
    return f"torchvision==0.{int(found.group(1)) + TORCHVISION_MINOR_OFFSET}.*"


def build_index(torch_version: str) -> str | None:
    """The index of an installed torch's build: its local version names it (`+cpu`, `+cu128`);
    a plain version came from the configured index."""
    local = torch_version.partition("+")[2]
    if not local:
        return None
    if local == "cpu":
        return CPU_INDEX
    return f"https://download.pytorch.org/whl/{local}"


def install_timm(torch_version: str, torchvision_version: str) -> int:
    """timm, with torch and torchvision held at the installed versions."""
    return installed(
        [sys.executable, "-m", "pip", "install", TIMM, f"torch=={torch_version}",
         f"torchvision=={torchvision_version}"],
        TIMM,
    )  # fmt: skip


def install_vision_beside(torch_version: str) -> int:
    """torchvision made for the installed torch (held where it is), from its build's index; then
    timm."""
    vision = torchvision_requirement(torch_version)
    command = [sys.executable, "-m", "pip", "install", vision, f"torch=={torch_version}"]
    index = build_index(torch_version)
    if index is not None:
        command += ["--index-url", index, "--extra-index-url", "https://pypi.org/simple"]
    print(f"Installing {vision} for the installed torch {torch_version}.")
    code = subprocess.call(command)
    if code != 0:
        print(
            f"error: pip could not install {vision} for the installed torch {torch_version} (its "
            f"output is above): no torchvision build matches it. {NO_TORCHVISION}",
            file=sys.stderr,
        )
        return code
    return checked_then_timm()


def torchvision_failure() -> str | None:
    """None where torchvision imports beside torch and finds its operators; else the last line of
    its error (a build for another torch: "operator torchvision::nms does not exist")."""
    result = subprocess.run(
        [sys.executable, "-c", "import torch, torchvision; torchvision.ops.nms"],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or ["no error message"])[-1]


def checked_then_timm() -> int:
    """timm, once the installed torchvision is seen to work with the installed torch; a
    torchvision that does not is uninstalled again, with one line saying so."""
    failure = torchvision_failure()
    torch_version = installed_version("torch")
    if failure is not None:
        subprocess.call([sys.executable, "-m", "pip", "uninstall", "--yes", "torchvision"])
        print(
            f"error: the torchvision that the index offers does not work with torch "
            f"{torch_version} ({failure}), so it was uninstalled: it is a build for another "
            f"torch. {NO_TORCHVISION}",
            file=sys.stderr,
        )
        return 1
    return install_timm(torch_version, installed_version("torchvision"))


NO_TORCHVISION = (
    "Pretrained backbones from Hugging Face folders need no torchvision "
    "(model/backbone=hugging_face); for timm, install a torch that has a matching torchvision: "
    "make install TORCH=torch VISION=1 in a fresh environment."
)


def installed_version(name: str) -> str:
    return importlib.metadata.version(name)


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
        vision = next((part for part in command if part.startswith("torchvision")), None)
        asked = f"{requirement} with {vision}" if vision else requirement
        also = f" {NO_TORCHVISION}" if vision else ""
        print(
            f"error: pip could not install {asked} (its output is above). Try "
            f"{other_version(requirement)}.{also}",
            file=sys.stderr,
        )
    return code


def main() -> int:
    arguments = [argument for argument in sys.argv[1:] if argument != "--vision"]
    vision = "--vision" in sys.argv[1:]
    requirement = arguments[0] if arguments else TESTED
    if importlib.util.find_spec("torch") is not None:
        print("torch is already installed; keeping it.")
        return install_vision_beside(installed_version("torch")) if vision else 0
    code = install_torch(requirement, vision)
    if code != 0 or not vision:
        return code
    return checked_then_timm()


def install_torch(requirement: str, vision: bool) -> int:
    """torch for this machine (and with `vision` the torchvision made for it, in the same pip
    command, from the same index)."""
    command = [sys.executable, "-m", "pip", "install", requirement]
    if vision:
        command.append(torchvision_requirement(requirement))
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
