"""What keeps the prepare command as fast as a plain script, checked without timing anything (the
bench shows speed: `bench.prepare=true`): it writes the bytes of the plain `tokenizers` + numpy
script that the bench times it against; its tokenizing workers are fresh interpreters that import
neither torch, Lightning nor Hydra, also when the command runs as a console script; and no process
of its process group outlives it, however it ends."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.recipes.bench.preparation import (
    PLAIN_SCRIPT,
    bench_preparation,
    same_bytes,
)
from {{ cookiecutter.package_name }}.recipes.prepare import (
    prepare,
)

from .helpers import PACKAGE, compose_config
from .test_token_shards import prepare_config, write_corpus

SMALL = ["vocab_size=300", "val_fraction=0.1", "test_fraction=0.1"]
HEAVY = {"torch", "lightning", "hydra", "omegaconf"}


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_the_command_writes_the_plain_scripts_bytes(tokenizer: str, tmp_path: Path) -> None:
    """Tokenizer and shards, byte for byte, on a corpus with a file that is not UTF-8, a hidden
    file, a `max_bytes` cut and several shards a split."""
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (corpus / ".hidden.py").write_text("hidden = True\n")
    settings = [*SMALL, "shard_tokens=3000", "max_bytes=50000", f"tokenizer={tokenizer}"]
    manifest = prepare(prepare_config(tmp_path, f"source={corpus}", *settings))
    plain = subprocess.run(
        [
            sys.executable, str(PLAIN_SCRIPT), str(corpus), str(tmp_path / "plain"),
            "--tokenizer", tokenizer, "--vocab-size", "300", "--val-fraction", "0.1",
            "--test-fraction", "0.1", "--shard-tokens", "3000", "--max-bytes", "50000",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert len(manifest["splits"]["train"]["shards"]) >= 2
    assert same_bytes(tmp_path / "tokens", tmp_path / "plain")
    shard = tmp_path / "plain" / manifest["splits"]["val"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert not same_bytes(tmp_path / "tokens", tmp_path / "plain"), "one bit differs"


# Records, at exit, each Python process's parent, command line and imported modules.
IMPORT_SPY = """
import atexit, json, os, sys

def _record():
    path = os.path.join(os.environ["IMPORT_SPY"], f"{os.getpid()}.json")
    with open(path, "w") as file:
        json.dump({"parent": os.getppid(), "argv": sys.argv, "modules": sorted(sys.modules)}, file)

atexit.register(_record)
"""


def test_tokenizing_workers_import_neither_torch_lightning_nor_hydra(tmp_path: Path) -> None:
    """Run as a console script runs it (a script file as the main module, which a spawned
    multiprocessing worker would import again): the command holds Hydra, its workers none of it."""
    spy, records = tmp_path / "spy", tmp_path / "records"
    spy.mkdir()
    records.mkdir()
    (spy / "sitecustomize.py").write_text(IMPORT_SPY)
    script = tmp_path / f"{PACKAGE}-prepare.py"
    script.write_text(
        f"import sys\nfrom {PACKAGE}.cli import prepare\n\nif __name__ == '__main__':\n"
        "    sys.exit(prepare())\n"
    )
    corpus = write_corpus(tmp_path / "corpus")
    environment = {
        "PYTHONPATH": f"{spy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "IMPORT_SPY": str(records),
    }
    command = subprocess.Popen(
        [
            sys.executable, str(script), f"source={corpus}", *SMALL, "workers=2",
            f"output={tmp_path / 'tokens'}",
        ],
        cwd=tmp_path, env={**os.environ, **environment}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, errors = command.communicate(timeout=300)
    assert command.returncode == 0, errors[-2000:]
    seen = {int(path.stem): json.loads(path.read_text()) for path in records.glob("*.json")}
    assert "hydra" in seen[command.pid]["modules"], "the spy sees the command's imports"
    workers = [record for record in seen.values() if record["parent"] == command.pid]
    assert [sorted(HEAVY & set(worker["modules"])) for worker in workers] == [[]] * len(workers)
    assert len(workers) == 2


def group_members(group: int) -> list[int]:
    """The processes of process group `group` that have not ended (a zombie has)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(process_group) == group and state != "Z":
            members.append(int(stat.parent.name))
    return members


def is_worker(pid: int) -> bool:
    """Whether `pid` runs a tokenizing worker: it has started that program (a child stopped
    before that would hold its parent up inside the fork)."""
    try:
        return "tokenizing_worker" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def unread_input(pid: int) -> int:
    """The bytes waiting in the pipe that is `pid`'s stdin: more than the tokenizer's name once
    the command sends batches, which it does after it has taken SIGTERM over."""
    pipe = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return int(struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, bytes(4)))[0])
    finally:
        os.close(pipe)


def wait_until(condition: Callable[[], object], what: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, f"the command ended before {what}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


# How the command ends: what happens to it while its workers tokenize, and its exit code.
ENDINGS = {
    "it finishes": 0,
    "a worker is killed": 1,
    "SIGTERM to the command": 143,
    "SIGTERM to its process group": 143,
    "SIGINT to its process group": None,  # Ctrl-C: a KeyboardInterrupt, any failing exit code
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_no_process_of_the_command_outlives_it(ending: str, tmp_path: Path) -> None:
    """The command's process group is empty once the command has exited. Its workers are
    stopped (SIGSTOP) as soon as they start, so that the command is still waiting on them when
    it is signalled; then nothing is left that looks prepared, not even the staging folder."""
    corpus = write_corpus(tmp_path / "corpus")
    command = subprocess.Popen(
        [
            sys.executable, "-c", f"from {PACKAGE}.cli import prepare; prepare()",
            f"source={corpus}", *SMALL, "workers=2", f"output={tmp_path / 'tokens'}",
        ],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        if ending != "it finishes":
            workers: list[int] = []

            def two_workers() -> bool:
                workers[:] = [pid for pid in group_members(command.pid) if is_worker(pid)]
                return len(workers) == 2

            wait_until(two_workers, "two workers", command)
            for worker in workers:
                os.kill(worker, signal.SIGSTOP)
            wait_until(lambda: max(map(unread_input, workers)) > 1000, "a batch sent", command)
            if ending == "a worker is killed":
                os.kill(workers[0], signal.SIGKILL)
            elif ending == "SIGTERM to the command":
                os.kill(command.pid, signal.SIGTERM)
            else:
                os.killpg(command.pid, signal.SIGTERM if "SIGTERM" in ending else signal.SIGINT)
        _, errors = command.communicate(timeout=120)
    finally:
        left = group_members(command.pid)
        with_workers = [pid for pid in left if pid != command.pid]
        for pid in with_workers:
            os.kill(pid, signal.SIGKILL)
        command.kill()
        command.wait()
    assert with_workers == [], f"processes of the command's group outlived it: {with_workers}"
    expected = ENDINGS[ending]
    if expected is None:
        assert command.returncode != 0
    else:
        assert command.returncode == expected, errors[-3000:]
    if ending == "a worker is killed":
        line = errors.strip().splitlines()[-1]
        assert line.startswith("error: a tokenizing worker process") and "SIGKILL" in line, line
    finished = ending == "it finishes"
    assert (tmp_path / "tokens" / "manifest.json").is_file() == finished
    assert not (tmp_path / ".tokens.tmp-prepare").exists()


def test_the_bench_times_the_command_against_the_plain_script(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    overrides = [f"source={corpus}", *SMALL]
    output = tmp_path / "bench.json"
    cfg = compose_config(
        "bench",
        [
            "bench.prepare=true", "bench.repeats=1", f"bench.output={output}",
            f"bench.prepare_overrides=[{','.join(repr(o) for o in overrides)}]",
        ],
        tmp_path,
    )  # fmt: skip
    results = bench_preparation(cfg)
    assert json.loads(output.read_text()) == results
    assert results["same_bytes"] is True
    assert len(results["prepare"]["seconds"]) == len(results["plain"]["seconds"]) == 1
    assert (
        results["ratio_median"] == results["prepare"]["seconds"][0] / results["plain"]["seconds"][0]
    )
    assert 0 < results["first_tokens_median_s"] < results["prepare"]["seconds"][0]
    assert results["settings"]["source"] == str(corpus)
    assert not list(tmp_path.glob("*tokens*")), "the runs' outputs are left in a scratch folder"


BAD_BENCH = {
    "output set": ("bench.prepare_overrides=['output=x']", "the bench sets output"),
    "workers set": ("bench.prepare_overrides=['workers=1']", "the bench sets output, workers"),
    "tokenizer a file": ("bench.prepare_overrides=['tokenizer=x.json']", "tokenizer=bpe or"),
    "not overrides": ("bench.prepare_overrides=[max_bytes]", "give a list of the prepare"),
}


@pytest.mark.parametrize("case", list(BAD_BENCH))
def test_the_prepare_bench_refuses_what_it_cannot_compare(case: str, tmp_path: Path) -> None:
    setting, message = BAD_BENCH[case]
    cfg = compose_config("bench", ["bench.prepare=true", setting], tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench_preparation(cfg)
    assert not tmp_path.exists() or not list(tmp_path.iterdir()), "nothing written"
