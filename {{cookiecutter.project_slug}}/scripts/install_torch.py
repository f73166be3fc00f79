"""Install torch for this machine, before the project: a CUDA build where an NVIDIA driver is
present, the CPU-only wheel otherwise (a few hundred MB instead of several GB).

    python scripts/install_torch.py [requirement]     # default requirement: "torch"

An installed torch is kept. Without a reachable CPU wheel index (an offline mirror, a proxy) the
requirement is installed from the configured package index as it is.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def main() -> int:
    requirement = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if importlib.util.find_spec("torch") is not None:
        print("torch is already installed; keeping it.")
        return 0
    command = [sys.executable, "-m", "pip", "install", requirement]
    if shutil.which("nvidia-smi"):
        print(f"NVIDIA driver found: installing {requirement} with CUDA.")
    elif reachable(CPU_INDEX + "/"):
        print(f"No NVIDIA driver: installing {requirement} from the CPU-only index.")
        command += ["--index-url", CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"]
    else:
        print(
            f"No NVIDIA driver and {CPU_INDEX} unreachable: installing {requirement} as configured."
        )
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
