"""The serve command as a user runs it: a real server process on a free loopback port, asked
over HTTP. Answers equal the model's own, concurrent requests run batched, bad requests get a
4xx and one JSON line, a hostile checkpoint is refused before anything listens, and a stop
signal ends the server and every process of it."""

from __future__ import annotations

import asyncio
{%- if cookiecutter.examples != "language" %}
import base64
{%- endif %}
{%- if cookiecutter.examples != "language" %}
import io
{%- endif %}
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.trained import (
    Trained,
    rebuild,
)
from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
{%- if cookiecutter.examples != "vision" %}
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
{%- endif %}
from {{ cookiecutter.package_name }}.recipes.serve import (
    serve,
)
from {{ cookiecutter.package_name }}.recipes.serve.app import (
    build_app,
)
from {{ cookiecutter.package_name }}.recipes.serve.batching import (
    Batcher,
    Pending,
)
from {{ cookiecutter.package_name }}.recipes.serve.settings import (
    Settings,
    check_settings,
)

from .fuzzing import CASES, mutate_bytes, mutated_json_text
from .helpers import PACKAGE, compose_config, run_cli
from .killing import entry_point as entry
from .killing import signal_group, start
{%- if cookiecutter.examples != "language" %}
from .test_use_vision import png_claiming, write_digit
{%- endif %}

QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
SERVING = re.compile(r"Serving at (http://\S+)")


class Server:
    """The serve command in its own process group, its output collected as it comes."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        # One thread: the tests' models are tiny, and the machine's cores are shared.
        self.process = start(["port=0", *args], cwd, {"OMP_NUM_THREADS": "1"}, entry="serve")
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()
        self.url = self.wait_until_serving()

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_until_serving(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = SERVING.search(line)
                if found:
                    return found.group(1)
            if self.process.poll() is not None:
                self.reader.join(timeout=10)
                raise AssertionError(f"the server ended:\n{self.output()[-5000:]}")
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"not serving after {timeout} s:\n{self.output()[-5000:]}")

    def stop(self, signal_number: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.process.send_signal(signal_number)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {timeout} s after {signal_number!r}") from None
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def processes_left(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture(scope="module")
def serving_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


def one_line_error(response: httpx.Response, status: int, *words: str) -> None:
    text = response.text
    assert response.status_code == status, (response.status_code, text)
    assert text.count("\n") == 0 and text.startswith("{"), text
    message = response.json()["error"]
    assert all(word in message for word in words), message


def rebuilt(ckpt: Path, tmp_path: Path) -> Trained:
    """The checkpoint's model and data as the commands rebuild them, here in the test."""
    cfg = compose_config("serve", [f"ckpt_path={ckpt}"], tmp_path)
    trained = rebuild(cfg.ckpt_path, False, cfg.data, cfg.model)
    trained.model.eval()
    return trained


def fuzzed_requests(
    ckpt: Path, tmp_path: Path, routes: dict[str, list[dict[str, Any]]], seed: int
) -> int:
    """Valid bodies for each route, mutated at random (tests/fuzzing.py), sent in this process
    to the app a server of `ckpt` runs: every answer is a 200 (a stream of JSON lines) or a 4xx
    whose body is one JSON line, never a 5xx. Returns how many were answered 200."""
    from starlette.testclient import TestClient

    cfg = compose_config("serve", [f"ckpt_path={ckpt}", "limits.request_bytes=8192"], tmp_path)
    settings = check_settings(cfg)
    trained = rebuilt(ckpt, tmp_path / "rebuilt")
    served: Any
{%- if cookiecutter.examples != "vision" %}
    if trained.datamodule.__class__.__name__ != "DigitsDataModule":
        from {{ cookiecutter.package_name }}.recipes.serve.generation import (
            Generation,
        )

        served = Generation(trained, settings, torch.device("cpu"), 0)
{%- endif %}
{%- if cookiecutter.examples != "language" %}
    if trained.datamodule.__class__.__name__ == "DigitsDataModule":
        from {{ cookiecutter.package_name }}.recipes.serve.classification import (
            Classification,
        )

        served = Classification(trained, settings, torch.device("cpu"))
{%- endif %}
    rng, answered = random.Random(seed), 0
    with TestClient(build_app(served, settings), raise_server_exceptions=False) as client:
        for case in range(CASES):
            route = rng.choice(list(routes))
            valid = rng.choice(routes[route])
            body = (
                mutated_json_text(valid, rng) if case % 2
                else mutate_bytes(json.dumps(valid).encode(), rng)
            )  # fmt: skip
            response = client.post(route, content=body)
            what = f"case {case}, {route}: {body[:300]!r} -> {response.status_code} {response.text[:300]}"
            assert response.status_code in (200, 400, 413), what
            lines = response.text.splitlines()
            assert lines and all(json.loads(line) for line in lines), what
            if response.status_code != 200:
                assert len(lines) == 1 and "error" in json.loads(lines[0]), what
            answered += response.status_code == 200
    return answered


async def ask_together(url: str, requests: list[Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Every request at once; each answer's status and JSON lines."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def ask(request: Any) -> tuple[int, list[dict[str, Any]]]:
            content = request if isinstance(request, bytes) else json.dumps(request).encode()
            response = await client.post(url, content=content)
            return response.status_code, [json.loads(line) for line in response.text.splitlines()]

        return await asyncio.gather(*(ask(request) for request in requests))


def test_python_dash_m_on_the_recipe_module_runs_the_command(tmp_path: Path) -> None:
    result = run_cli("-m", f"{PACKAGE}.recipes.serve", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "task_name: serve\n" in result.stdout


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_checkpoint_is_refused_before_anything_listens(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.ckpt"
    torch.save({"state_dict": {}, "run_config": RunsCode(marker)}, hostile)
    result = run_cli(*entry("serve"), f"ckpt_path={hostile}", "port=0", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert str(hostile) in lines[0] and "Serving at" not in result.stdout
    assert not marker.exists()
    assert not (tmp_path / "logs").exists()


def test_a_taken_port_gets_one_line_before_the_checkpoint_is_read(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(*entry("serve"), "ckpt_path=missing.ckpt", f"port={port}", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1 port {port}" in lines[0] and "port=0" in lines[0]
    assert not (tmp_path / "logs").exists()


class Recorded:
    """A model that answers at once and records the batches it ran."""

    kind, path = "recorded", "/recorded"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def groups(self, batch: list[Pending]) -> list[list[Pending]]:
        return [batch]

    def run(self, group: list[Pending], stopping: threading.Event) -> None:
        self.batches.append(len(group))
        for pending in group:
            pending.send({"done": True})


def test_a_request_that_finds_the_model_idle_starts_at_once_and_a_busy_model_batches() -> None:
    """With a batch_timeout of a minute, a lone request is answered without waiting for it; two
    requests queued while the model was busy run as one batch (a full one: max_batch_size 2)."""
    settings = Settings(host="127.0.0.1", port=0, max_batch_size=2, batch_timeout=60.0,
                        shutdown_timeout=1, max_new_tokens=1, temperature=0.0, top_k=None,
                        top_k_classes=1, request_bytes=1024, most_new_tokens=1, image_pixels=1,
                        queued_requests=8)  # fmt: skip
    served = Recorded()
    batcher = Batcher(served, settings)  # type: ignore[arg-type]

    async def ask(count: int) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        pendings = [Pending(torch.zeros(1), {}, loop) for _ in range(count)]
        for pending in pendings:
            assert batcher.submit(pending)
        if not batcher.thread.is_alive():
            batcher.thread.start()
        return [await asyncio.wait_for(pending.final(), timeout=30) for pending in pendings]

    async def both() -> None:
        assert await ask(2) == [{"done": True}] * 2  # queued before the model ran: busy
        assert await ask(1) == [{"done": True}]  # the model idle: no minute's wait

    try:
        asyncio.run(both())
    finally:
        batcher.stop()
    assert served.batches == [2, 1]


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("max_batch_size=0", "max_batch_size=0"),
        ("batch_timeout=-1", "batch_timeout=-1"),
        ("device=tpu", "device='tpu'"),
        ("port=70000", "port=70000"),
        ("host=''", "host=''"),
        ("max_new_tokens=5000", "limits.max_new_tokens=2048"),
        ("temperature=nan", "temperature=nan"),
        ("limits.request_bytes=0", "limits.request_bytes=0"),
        ("limits.connections=100000000", "open-files limit"),
        ("limits.header_seconds=0", "limits.header_seconds=0"),
        ("limits.body_seconds=-1", "limits.body_seconds=-1"),
    ],
)
def test_settings_a_server_cannot_use_are_refused(setting: str, words: str, tmp_path: Path) -> None:
    cfg = compose_config("serve", ["ckpt_path=missing.ckpt", setting], tmp_path)
    with pytest.raises(ConfigError, match=re.escape(words)):
        serve(cfg)
{%- if cookiecutter.examples != "vision" %}


# The language model: prompts of different lengths batched give what each gives alone.


def tiny_gpt(block_size: int = 16) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=block_size, n_layer=2, n_head=2, n_embd=32).eval()


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(prompt) for prompt in prompts)
    idx = torch.zeros(len(prompts), longest, dtype=torch.long)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        idx[row, longest - len(prompt) :] = prompt
        real[row, longest - len(prompt) :] = True
    return idx, real


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_padded_batch_gives_each_row_what_it_gives_alone(kv_cache: bool) -> None:
    """Greedy, past the context (16) too, each row ending at its own count or stop token."""
    net = tiny_gpt()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in (3, 9, 1, 16, 6)]
    counts = [20, 5, 12, 1, 30]
    alone = [
        net.generate(prompt[None], count, temperature=0, kv_cache=kv_cache)[0, len(prompt) :]
        for prompt, count in zip(prompts, counts, strict=True)
    ]
    idx, real = left_padded(prompts)
    batched = net.generate(idx, counts, temperature=0, kv_cache=kv_cache, padding_mask=real)
    assert batched.shape == (5, idx.size(1) + 30)
    for row, tokens in enumerate(alone):
        assert torch.equal(batched[row, idx.size(1) : idx.size(1) + counts[row]], tokens), row
    # A stop token that row 0 makes at its third step: it ends there, keeping it, and the rest
    # of its row holds the stop token; the other rows end where they make it, if they do.
    stop = int(alone[0][2])
    stopped = net.generate(idx, counts, temperature=0, kv_cache=kv_cache, padding_mask=real,
                           stop_token=stop)  # fmt: skip
    for row, tokens in enumerate(alone):
        new = stopped[row, idx.size(1) :].tolist()
        made = tokens.tolist()
        end = made.index(stop) + 1 if stop in made else len(made)
        assert new[:end] == made[:end], row
        assert all(token == stop for token in new[end:]), row
    assert stopped[0, idx.size(1) + 2] == stop


class Collected:
    """A request whose events are kept (what the running batch sends an HTTP request)."""

    def __init__(self, prompt: torch.Tensor, count: int, **options: Any) -> None:
        self.inputs = prompt
        self.options = {"max_new_tokens": count, "temperature": 0.0, "top_k": None,
                        "stream": False, **options}  # fmt: skip
        self.events: list[dict[str, Any]] = []

    def send(self, event: dict[str, Any]) -> None:
        self.events.append(event)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_requests_join_and_leave_the_running_batch_and_get_what_they_get_alone(
    compiled: bool,
) -> None:
    """Continuous batching (recipes/serve/continuous.py): requests join between decode steps,
    each with its own length, count and sampling, and leave at their own end; the greedy ones get
    the tokens `generate` gives them alone, past the context (16) too. Compiled, every step
    replays one graph."""
    from {{ cookiecutter.package_name }}.recipes.serve.continuous import (
        Rows,
    )
    from {{ cookiecutter.package_name }}.recipes.serve.generation import (
        Continuation,
    )

    net = tiny_gpt()

    class Generation:  # what the running batch needs of the served model
        device, stop_token = torch.device("cpu"), None
        generator = torch.Generator().manual_seed(0)

        def __init__(self) -> None:
            self.net = net

        def continuation(self, pending: Any) -> Continuation:
            return Continuation(pending, lambda tokens: bytes(tokens).decode("latin-1"), 1)

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in (3, 9, 1, 16, 6, 4)]
    counts = [20, 5, 12, 1, 30, 8]
    requests = [Collected(prompt, count) for prompt, count in zip(prompts, counts, strict=True)]
    sampled = Collected(prompts[0], 10, temperature=0.9, top_k=20)
    rows = Rows(Generation(), 3, compiled)
    arrivals = {0: [requests[0], sampled], 2: [requests[1]], 3: [requests[2], requests[3]],
                7: [requests[4]], 8: [requests[5]]}  # fmt: skip
    waiting: list[Collected] = []
    with torch.inference_mode():
        for step in range(200):
            waiting += arrivals.get(step, [])
            while waiting and rows.free:
                rows.join(waiting.pop(0))  # type: ignore[arg-type]
            if rows.active:
                rows.step()
            elif step > max(arrivals):
                break
    assert not waiting and not rows.active
    for request, prompt, count in zip(requests, prompts, counts, strict=True):
        alone = net.generate(prompt[None], count, temperature=0)[0, len(prompt) :]
        (answer,) = request.events
        assert answer["completion"] == bytes(alone.tolist()).decode("latin-1")
        assert answer["tokens"] == count and answer["finish_reason"] == "length"
    assert sampled.events[0]["tokens"] == 10
    sizes = [request.events[0]["batch_size"] for request in requests]
    assert max(sizes) == 3 and min(sizes) >= 1, sizes


def test_a_padded_forward_gives_each_row_the_logits_it_gives_alone() -> None:
    net = tiny_gpt()
    prompts = [torch.randint(0, 256, (n,)) for n in (4, 11, 1)]
    idx, real = left_padded(prompts)
    with torch.no_grad():
        batched = net(idx, padding_mask=real)
        for row, prompt in enumerate(prompts):
            alone = net(prompt[None])[0]
            torch.testing.assert_close(batched[row, -len(prompt) :], alone, atol=1e-5, rtol=1e-5)
        # In pieces through the cache, as generation runs.
        cache = net.new_cache()
        first = net(idx[:, :6], cache, real[:, :6])
        rest = net(idx[:, 6:], cache, real)
        torch.testing.assert_close(torch.cat([first, rest], dim=1), batched, atol=1e-5, rtol=1e-5)


TINY = ["model.net.n_layer=1", "model.net.n_embd=64", "model.net.n_head=2", "data.block_size=64"]


@pytest.fixture(scope="module")
def language_checkpoint(serving_dir: Path) -> Path:
    """The byte-level language example, trained for a few steps."""
    cwd = serving_dir / "language"
    cwd.mkdir()
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=language", *TINY, "data.max_bytes=100000",
        "trainer.max_steps=10", "trainer.val_check_interval=10", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=1", "run_name=base", cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "base" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def language_server(language_checkpoint: Path, serving_dir: Path) -> Iterator[Server]:
    server = Server(
        [f"ckpt_path={language_checkpoint}", "limits.request_bytes=4096"],
        serving_dir / "language",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def language_net(language_checkpoint: Path, serving_dir: Path) -> GPT:
    net: GPT = rebuilt(language_checkpoint, serving_dir / "rebuilt").model.net  # type: ignore[assignment]
    return net


def greedy(net: GPT, prompt: str, count: int) -> str:
    tokens = list(prompt.encode())
    out = net.generate(torch.tensor([tokens]), count, temperature=0)[0, len(tokens) :]
    return bytes(out.tolist()).decode("utf-8", errors="replace")


def test_greedy_answers_are_the_models_own(language_server: Server, language_net: GPT) -> None:
    """One prompt at a time, a full context (64 bytes) and past it."""
    for prompt, count in [("def main(", 30), ("x" * 64, 100), ("é", 3)]:
        response = httpx.post(f"{language_server.url}/generate", timeout=120, json={
            "prompt": prompt, "max_new_tokens": count, "temperature": 0,
        })  # fmt: skip
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["completion"] == greedy(language_net, prompt, count)
        assert answer["tokens"] == count and answer["finish_reason"] == "length"


def test_a_request_joins_a_running_generation_and_ends_before_it(
    language_server: Server, language_net: GPT
) -> None:
    """A short request sent while a long one streams runs beside it (it does not wait for the
    long one to end) and each gets its greedy tokens alone. (The long one runs past the context
    of 64, where each of its tokens is a refill of the window, run alone.)"""
    long, short = ("import os\n", 400), ("def f(", 10)
    url = f"{language_server.url}/generate"
    ended: dict[str, float] = {}
    answers: dict[str, dict[str, Any]] = {}

    def stream_long() -> None:
        pieces = []
        with httpx.stream("POST", url, timeout=120, json={
            "prompt": long[0], "max_new_tokens": long[1], "temperature": 0, "stream": True,
        }) as response:  # fmt: skip
            for line in response.iter_lines():
                event = json.loads(line)
                pieces.append(event.get("text", ""))
                if len(pieces) == 20:
                    started.set()
                if event.get("done"):
                    answers["long"] = {**event, "completion": "".join(pieces)}
        ended["long"] = time.monotonic()

    started = threading.Event()
    thread = threading.Thread(target=stream_long)
    thread.start()
    assert started.wait(120), "the long request streams"
    response = httpx.post(url, timeout=120, json={
        "prompt": short[0], "max_new_tokens": short[1], "temperature": 0,
    })  # fmt: skip
    ended["short"] = time.monotonic()
    thread.join(120)
    answers["short"] = response.json()
    assert ended["short"] < ended["long"], "the short request did not wait for the long one"
    for name, (prompt, count) in (("long", long), ("short", short)):
        assert answers[name]["completion"] == greedy(language_net, prompt, count), name


def test_the_comparison_with_a_plain_server_runs_and_the_texts_agree(
    language_checkpoint: Path, tmp_path: Path
) -> None:
    """scripts/serve_against_plain.py, as docs/benchmarks.md runs it, on few small requests."""
    import sys

    from .helpers import PROJECT_ROOT

    output = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "scripts" / "serve_against_plain.py"),
         str(language_checkpoint), "--clients", "1", "3", "--per-client", "2",
         "--new-tokens", "6", "--output", str(output)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(output.read_text())
    assert [row["clients"] for row in rows] == [1, 3]
    for row in rows:
        assert row["same_texts"], row
        assert row["ratio"] == pytest.approx(
            row["serve"]["tokens_per_sec"] / row["plain"]["tokens_per_sec"]
        )
    assert result.stdout.count("| True |") == 2


def test_a_stream_comes_token_by_token_and_adds_up_to_the_answer(language_server: Server) -> None:
    request = {"prompt": "import os\n", "max_new_tokens": 300, "temperature": 0}
    whole = httpx.post(f"{language_server.url}/generate", json=request, timeout=120).json()
    arrivals, events = [], []
    began = time.monotonic()
    with httpx.stream("POST", f"{language_server.url}/generate", timeout=120,
                      json={**request, "stream": True}) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        for line in response.iter_lines():
            arrivals.append(time.monotonic() - began)
            events.append(json.loads(line))
    *pieces, done = events
    assert done == {"done": True, "tokens": 300, "finish_reason": "length", "batch_size": 1}
    assert "".join(piece["text"] for piece in pieces) == whole["completion"]
    assert len(pieces) >= 200, "one line a token (a character split over bytes waits)"
    # Buffered, every line would come in one read; streamed, they spread over the generation.
    spread, generating = arrivals[-1] - arrivals[0], arrivals[-1]
    assert spread > generating / 4, f"lines came over {spread:.3f} s of {generating:.3f} s"


def test_concurrent_requests_run_batched_and_each_gets_its_own_answer(
    language_server: Server, language_net: GPT
) -> None:
    """20 prompts of different lengths asking for different counts, some streamed, and two bad
    requests among them that fail alone."""
    prompts = [f"{'#' * (index % 7)}def f{index}(" for index in range(20)]
    counts = [5 + (index * 7) % 40 for index in range(20)]
    requests: list[Any] = [
        {"prompt": prompt, "max_new_tokens": count, "temperature": 0, "stream": index % 3 == 0}
        for index, (prompt, count) in enumerate(zip(prompts, counts, strict=True))
    ]
    requests[7:7] = [b"not json", {"prompt": "x" * 65}]
    answers = asyncio.run(ask_together(f"{language_server.url}/generate", requests))
    assert [status for status, _ in answers[7:9]] == [400, 400]
    del answers[7:9]
    sizes = []
    for index, (status, events) in enumerate(answers):
        assert status == 200, events
        if index % 3 == 0:
            *pieces, done = events
            completion = "".join(piece["text"] for piece in pieces)
        else:
            (done,) = events
            completion = done["completion"]
        assert completion == greedy(language_net, prompts[index], counts[index]), index
        assert done["tokens"] == counts[index]
        sizes.append(done["batch_size"])
    assert max(sizes) >= 4, sizes


def test_bad_requests_get_a_4xx_and_one_json_line(language_server: Server) -> None:
    url = f"{language_server.url}/generate"
    cases: list[tuple[Any, int, tuple[str, ...]]] = [
        (b"{nope", 400, ("not JSON",)),
        (b"\xff\xfe", 400, ("not JSON",)),
        (b"[" * 3000, 400, ("nests deeper",)),
        ([1, 2], 400, ("JSON object",)),
        ({}, 400, ("prompt is missing",)),
        ({"prompt": 5}, 400, ("prompt must be a string",)),
        ({"prompt": ""}, 400, ("empty",)),
        ({"prompt": "", "stream": True}, 400, ("empty",)),
        (b'{"prompt": "\\ud800"}', 400, ("not valid Unicode",)),
        ({"prompt": "x" * 65}, 400, ("65 tokens", "context of 64")),
        ({"prompt": "hi", "max_new_tokens": 0}, 400, ("max_new_tokens=0",)),
        ({"prompt": "hi", "max_new_tokens": 5000}, 400, ("max_new_tokens=5000", "limit of 2048")),
        ({"prompt": "hi", "max_new_tokens": "5"}, 400, ('max_new_tokens="5"',)),
        ({"prompt": "hi", "max_new_tokens": True}, 400, ("max_new_tokens=true",)),
        ({"prompt": "hi", "temperature": -1}, 400, ("temperature=-1",)),
        ({"prompt": "hi", "temperature": "hot"}, 400, ('temperature="hot"',)),
        ({"prompt": "hi", "top_k": 0}, 400, ("top_k=0",)),
        ({"prompt": "hi", "stream": "yes"}, 400, ('stream="yes"',)),
        ({"prompt": "hi", "colour": "red"}, 400, ("unknown field(s) colour",)),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, ("not trained on instructions",)),
        ({"messages": [], "prompt": "hi"}, 400, ("unknown field(s) prompt",)),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, ("limit of 4096 bytes",)),
    ]
    for body, status, words in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        one_line_error(httpx.post(url, content=content, timeout=60), status, *words)
    one_line_error(httpx.post(f"{language_server.url}/classify", json={}), 404, "POST /generate")
    one_line_error(httpx.get(url), 405, "POST /generate")
    health = httpx.get(f"{language_server.url}/health").json()
    assert health == {"status": "ok", "model": "language"}
    info = httpx.get(f"{language_server.url}/info").json()
    limits = info["limits"]
    assert (info["batching"], info["context"], limits["request_bytes"]) == ("continuous", 64, 4096)


def test_fuzzed_requests_get_an_answer_or_a_4xx_and_one_json_line(
    language_checkpoint: Path, tmp_path: Path
) -> None:
    routes: dict[str, list[dict[str, Any]]] = {
        "/generate": [
            {"prompt": "def f(", "max_new_tokens": 4, "temperature": 0.5, "top_k": 5},
            {"prompt": "import os", "max_new_tokens": 3, "stream": True},
        ],
        "/v1/completions": [
            {"model": "base", "prompt": "def f(", "max_tokens": 4, "temperature": 0},
            {"model": "base", "prompt": ["x", "y"], "max_tokens": 2, "stream": True, "seed": 1},
        ],
        "/v1/chat/completions": [
            {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ],
    }
    answered = fuzzed_requests(language_checkpoint, tmp_path, routes, seed=10)
    assert answered > 0, "no mutated request was answered: the valid ones are not valid"


def test_openais_client_gets_the_models_completions_streamed_or_not(
    language_server: Server, language_net: GPT
) -> None:
    """OpenAI's own Python client, pointed at /v1: a completion, the same streamed (server-sent
    events adding up to it), the model list, and refusals in OpenAI's error shape."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{language_server.url}/v1", api_key="unused", timeout=120)
    (listed,) = client.models.list().data
    assert listed.id == "base"  # the training run's name
    prompt, count = "def main(", 30
    completion = client.completions.create(
        model=listed.id, prompt=prompt, max_tokens=count, temperature=0
    )
    (choice,) = completion.choices
    assert choice.text == greedy(language_net, prompt, count)
    assert choice.finish_reason == "length" and completion.object == "text_completion"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (9, count)
    stream = client.completions.create(
        model=listed.id, prompt=[prompt], max_tokens=count, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "length"
    assert len(chunks) > count / 2, "a chunk a token (a character split over bytes waits)"
    refusals: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"n": 2}, ("n=2", "not supported")),
        ({"top_p": 0.5}, ("top_p=0.5", "not supported")),
        ({"stop": ["\n"]}, ("stop=", "not supported")),
        ({"max_tokens": 5000}, ("max_new_tokens=5000", "limit of 2048")),
        ({"temperature": -1}, ("temperature=-1",)),
        ({"prompt": ["a", "b"]}, ("one prompt a request",)),
    ]
    for fields, words in refusals:
        request = {"model": "base", "prompt": prompt, "max_tokens": 4, **fields}
        response = httpx.post(f"{language_server.url}/v1/completions", json=request, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "\n" not in response.text
        assert all(word in error["message"] for word in words), error
    with pytest.raises(openai.BadRequestError, match="not trained on instructions"):
        client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    # Fields the client sends at their neutral values pass.
    neutral = client.completions.create(
        model="base", prompt=prompt, max_tokens=3, temperature=0, n=1, top_p=1,
        presence_penalty=0, frequency_penalty=0, user="someone", seed=1,
    )  # fmt: skip
    assert neutral.choices[0].text == choice.text[: len(neutral.choices[0].text)]
{%- endif %}
{%- if cookiecutter.examples != "language" %}


# The image classifier: digits images in, their top-k classes out.


@pytest.fixture(scope="module")
def digits_checkpoint(serving_dir: Path) -> Path:
    cwd = serving_dir / "digits"
    cwd.mkdir()
    result = run_cli("-m", PACKAGE, *QUIET, "experiment=digits", "trainer.max_epochs=3",
                     "run_name=digits", cwd=cwd)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "digits" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def digits_server(digits_checkpoint: Path, serving_dir: Path) -> Iterator[Server]:
    server = Server([f"ckpt_path={digits_checkpoint}", "batch_timeout=0.2"], serving_dir / "digits")
    yield server
    server.stop()


def encoded(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_images_get_the_models_top_classes_batched(
    digits_server: Server, digits_checkpoint: Path, tmp_path: Path
) -> None:
    from {{ cookiecutter.package_name }}.data.digits import (
        load_digits,
    )

    images, labels = load_digits()
    paths = []
    for index in range(12):
        paths.append(tmp_path / f"{index}.png")
        write_digit(images[index], paths[-1], scale=1 + index % 4)
    requests = [{"image": encoded(path), "top_k": 3} for path in paths]
    answers = asyncio.run(ask_together(f"{digits_server.url}/classify", requests))
    trained = rebuilt(digits_checkpoint, tmp_path / "rebuilt")
    datamodule: Any = trained.datamodule
    read = datamodule.images_from_files(paths)
    with torch.no_grad():
        batch = datamodule.on_after_batch_transfer((read, torch.zeros(len(paths))), 0)
        expected = trained.model.predict_step(batch, 0).topk(3, dim=1)
    correct = 0
    for (status, (answer,)), classes, chances, label in zip(
        answers, expected.indices.tolist(), expected.values.tolist(), labels[:12].tolist(),
        strict=True,
    ):  # fmt: skip
        assert status == 200, answer
        assert [item["class"] for item in answer["classes"]] == classes
        probabilities = [item["probability"] for item in answer["classes"]]
        assert probabilities == pytest.approx(chances, abs=1e-5)
        correct += classes[0] == label
    assert correct >= 6, answers
    assert max(answer["batch_size"] for _, (answer,) in answers) >= 4, answers
    response = httpx.post(f"{digits_server.url}/classify", json={"image": encoded(paths[0])})
    assert len(response.json()["classes"]) == 3, "top_k_classes when the request does not say"


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\nshowpage\n"


def test_image_files_are_opened_only_as_the_formats_the_models_train_on() -> None:
    """Pillow alone takes EPS for PostScript (which it runs Ghostscript on); the project's
    reader never tries that plugin."""
    from PIL import Image, UnidentifiedImageError

    from {{ cookiecutter.package_name }}.data.image_files import (
        open_image,
    )

    with Image.open(io.BytesIO(EPS)) as image:
        assert image.format == "EPS"
    with pytest.raises(UnidentifiedImageError):
        open_image(io.BytesIO(EPS))
    with open_image(io.BytesIO(png_claiming(2, 3))) as image:
        assert image.format == "PNG" and image.size == (2, 3)


def test_fuzzed_image_requests_get_an_answer_or_a_4xx_and_one_json_line(
    digits_checkpoint: Path, tmp_path: Path
) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (8, 8), 128).save(buffer, "PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    routes = {"/classify": [{"image": image, "top_k": 3}, {"image": image}]}
    answered = fuzzed_requests(digits_checkpoint, tmp_path, routes, seed=11)
    assert answered > 0, "no mutated request was answered: the valid ones are not valid"


def test_bad_images_get_a_4xx_and_one_json_line(digits_server: Server, tmp_path: Path) -> None:
    url = f"{digits_server.url}/classify"
    bomb = base64.b64encode(png_claiming(5000, 5000)).decode()
    cases: list[tuple[Any, int, tuple[str, ...]]] = [
        ({"image": "not base64!"}, 400, ("not base64",)),
        ({"image": base64.b64encode(b"no image here").decode()}, 400, ("does not decode",)),
        ({"image": bomb}, 413, ("5000x5000 pixels",)),
        ({"image": 5}, 400, ("image must be a string",)),
        ({"picture": "x"}, 400, ("unknown field(s) picture",)),
        ({"image": base64.b64encode(png_claiming(1, 1)).decode(), "top_k": 0}, 400, ("top_k=0",)),
        # Past twice Pillow's pixel limit, Pillow itself refuses: still 413.
        ({"image": base64.b64encode(png_claiming(30_000, 30_000)).decode()}, 413, ("too large",)),
        # PostScript is no format the server opens (Pillow would run Ghostscript on it).
        ({"image": base64.b64encode(EPS).decode()}, 400, ("does not decode",)),
    ]
    for body, status, words in cases:
        response = httpx.post(url, json=body, timeout=60)
        one_line_error(response, status, *words)
        assert not re.search(r"0x[0-9a-f]{6}", response.text), "no memory address in an answer"
    one_line_error(httpx.post(f"{digits_server.url}/generate", json={}), 404, "POST /classify")
{%- endif %}


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stop_signal_ends_the_server_and_leaves_no_process(
{%- if cookiecutter.examples != "vision" %}
    language_checkpoint: Path, tmp_path: Path, signal_number: int
{%- else %}
    digits_checkpoint: Path, tmp_path: Path, signal_number: int
{%- endif %}
) -> None:
{%- if cookiecutter.examples != "vision" %}
    """Also while it streams an answer: new requests get 503 meanwhile, and the stream, given
    `shutdown_timeout` seconds to finish, ends with a line saying the server stops."""
    limits = ["shutdown_timeout=3", "limits.max_new_tokens=100000"]
    server = Server([f"ckpt_path={language_checkpoint}", *limits], tmp_path)
    request = {"prompt": "def main(", "max_new_tokens": 100000, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=request, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        began = time.monotonic()
        server.process.send_signal(signal_number)
        while "new ones get 503" not in server.output():
            assert time.monotonic() - began < 30, server.output()[-3000:]
            time.sleep(0.05)
        one_line_error(httpx.post(f"{server.url}/generate", json={"prompt": "hi"}), 503, "stopping")
        last = json.loads(list(lines)[-1])
    assert last == {"error": "the server is stopping: send the request again later"}, last
    code = server.stop(signal_number)
{%- else %}
    server = Server([f"ckpt_path={digits_checkpoint}"], tmp_path)
    began = time.monotonic()
    code = server.stop(signal_number)
{%- endif %}
    assert code == 0, server.output()[-3000:]
    assert time.monotonic() - began < 30
    assert f"Stopped by {signal.Signals(signal_number).name}" in server.output()
    assert "Traceback" not in server.output(), server.output()[-3000:]
    assert not server.processes_left()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def read_answer(connection: socket.socket) -> tuple[int, dict[str, Any]]:
    """A whole HTTP/1.1 answer that closes the connection: its status and JSON body."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert body.count(b"\n") == 0, data
    return int(head.split()[1]), json.loads(body)


def test_slow_or_idle_clients_get_a_4xx_and_connections_past_the_bound_a_503(
{%- if cookiecutter.examples != "vision" %}
    language_checkpoint: Path, tmp_path: Path
{%- else %}
    digits_checkpoint: Path, tmp_path: Path
{%- endif %}
) -> None:
    """Headers that never end and a body that never comes get 408 after their limits; with the
    bound's connections held open by clients that send nothing, the next gets 503 at once (and
    the log says so once); 20 malformed requests leave one line in the log, not 20; once those
    time out, the server answers again."""
{%- if cookiecutter.examples != "vision" %}
    checkpoint, path, body = language_checkpoint, "/generate", {"prompt": "hi", "max_new_tokens": 2}
{%- else %}
    checkpoint, path, body = digits_checkpoint, "/classify", {"image": "x"}
{%- endif %}
    limits = ["limits.connections=4", "limits.header_seconds=2", "limits.body_seconds=2"]
    server = Server([f"ckpt_path={checkpoint}", *limits], tmp_path)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as slow:
            slow.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())  # never ends
            began = time.monotonic()
            status, answer = read_answer(slow)
        assert (status, 1.5 < time.monotonic() - began < 20) == (408, True), answer
        assert "limits.header_seconds=2" in answer["error"]
        with socket.create_connection((host, int(port)), timeout=30) as slow:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            slow.sendall(head.encode() + b"[")  # a body that stops after its first byte
            status, answer = read_answer(slow)
        assert status == 408 and "limits.body_seconds=2" in answer["error"], answer
        idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
        time.sleep(0.3)
        for _ in range(3):  # a 503 (the bound's), not a 408 after header_seconds
            with socket.create_connection((host, int(port)), timeout=30) as refused:
                status, answer = read_answer(refused)
            assert status == 503 and "too many connections" in answer["error"], answer
        assert server.output().count("get 503 (logged once)") == 1, server.output()[-3000:]
        for connection in idle:  # each gets its 408 after header_seconds, and is closed
            assert read_answer(connection)[0] == 408
            connection.close()
        for _ in range(20):  # malformed requests: uvicorn warns of each, the log holds one
            with socket.create_connection((host, int(port)), timeout=30) as garbage:
                garbage.sendall(b"\x00\x01 not HTTP\r\n\r\n")
                garbage.recv(1024)
        time.sleep(0.5)
        assert server.output().count("Invalid HTTP request") == 1, server.output()[-3000:]
        assert httpx.post(f"{server.url}{path}", json=body, timeout=60).status_code in (200, 400)
    finally:
        assert server.stop() == 0, server.output()[-3000:]
