"""Token shards streamed from a URL (data/streaming.py): from a file:// URL and from an HTTP server
that this test runs (ranged reads, as object stores serve them), never copied whole."""

from __future__ import annotations

import importlib.util
import re
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from {{ cookiecutter.package_name }}.command_errors import (
    without_worker_trace,
)
from {{ cookiecutter.package_name }}.data.streaming import (
    PageOrderSampler,
    StreamedWindows,
)
from {{ cookiecutter.package_name }}.data.token_shards import (
    SPLITS,
    TokenShardDataModule,
    read_manifest,
)
from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.recipes.prepare import (
    prepare,
)

from .helpers import PACKAGE, run_cli
from .killing import (
    References,
    assert_same_outcome,
    fault,
    killed_then_finished,
)
from .test_token_shards import HARD_TEXT, prepare_config, shard_run, write_corpus


class RangeHandler(SimpleHTTPRequestHandler):
    """Files of a folder, whole or by `Range: bytes=a-b`, counting the bytes sent per file; the
    next `faults["busy"]` ranged requests get a 503, and `faults["whole"]` sends whole files."""

    sent: Counter[str]
    faults: Counter[str]

    def send_head(self) -> Any:
        path = Path(self.translate_path(self.path))
        wanted = self.headers.get("Range", "")
        if not path.is_file() or not wanted.startswith("bytes=") or self.faults["whole"]:
            return super().send_head()
        if self.faults["busy"] > 0:
            self.faults["busy"] -= 1
            self.send_error(503, "busy")
            return None
        size = path.stat().st_size
        first, _, last = wanted[len("bytes=") :].partition("-")
        start, stop = int(first), min(int(last or size - 1), size - 1) + 1
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(stop - start))
        self.end_headers()
        self.sent[path.name] += stop - start
        with open(path, "rb") as file:
            file.seek(start)
            self.wfile.write(file.read(stop - start))
        return None

    def copyfile(self, source: Any, outputfile: Any) -> None:  # a whole file
        data = source.read()
        self.sent[Path(source.name).name] += len(data)
        outputfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class RangeServer:
    def __init__(self, root: Path) -> None:
        self.sent: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        handler = type("Handler", (RangeHandler,), {"sent": self.sent, "faults": self.faults})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=root))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE of 300 tokens, in shards of 2,000 tokens."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), files=60)
    folder = tmp_path_factory.mktemp("prepared")
    settings = ["vocab_size=300", "shard_tokens=2000", "val_fraction=0.1", "test_fraction=0.1"]
    prepare(prepare_config(folder, f"source={corpus}", *settings))
    return folder / "tokens"


@pytest.fixture(scope="module")
def server(prepared: Path) -> Iterator[RangeServer]:
    served = RangeServer(prepared.parent)
    yield served
    served.server.shutdown()


def streamed(url: str, **settings: Any) -> TokenShardDataModule:
    module = TokenShardDataModule(url, vocab_size=300, block_size=16, **settings)
    module.setup("fit")
    return module


def test_streamed_windows_are_the_memory_mapped_ones(prepared: Path, server: RangeServer) -> None:
    local = TokenShardDataModule(str(prepared), vocab_size=300, block_size=16)
    local.setup("fit")
    for url in (prepared.as_uri(), f"{server.url}/tokens"):
        module = streamed(url, read_mb=0.001)  # pages of 32 windows: many page edges
        for split in SPLITS:
            mapped, windows = local.splits[split], module.splits[split]
            assert isinstance(windows, StreamedWindows) and len(windows) == len(mapped) > 64
            for index in range(len(mapped)):
                assert all(map(torch.equal, windows[index], mapped[index])), (url, split, index)
        assert module.decode(module.encode(HARD_TEXT)) == HARD_TEXT, "the URL's tokenizer"


def rank_order(dataset: StreamedWindows, rank: int, epoch: int = 0, **kw: Any) -> list[int]:
    sampler = PageOrderSampler(dataset, 2, rank, seed=3, **{**dict(streams=2, batch_size=4,
                               shuffle=True, shuffle_pages=2), **kw})  # fmt: skip
    sampler.set_epoch(epoch)
    order = list(sampler)
    assert len(order) == len(sampler)
    return order


def test_ranks_read_disjoint_whole_pages_in_an_order_that_resumes(prepared: Path) -> None:
    dataset = streamed(prepared.as_uri(), read_mb=0.001).splits["train"]
    assert isinstance(dataset, StreamedWindows)
    dataset.fit_pages(4)
    pages = dataset.page_windows
    orders = [rank_order(dataset, rank) for rank in (0, 1)]
    assert len(orders[0]) == len(orders[1])
    assert 2 * len(orders[0]) > len(dataset) - 3 * pages, "under a page a rank, and one, left out"
    assert not set(orders[0]) & set(orders[1])
    for order in orders:
        assert len(set(order)) == len(order)
        assert all(n == pages for n in Counter(i // pages for i in order).values())
    assert orders[0] != sorted(orders[0]), "shuffled"
    assert rank_order(dataset, 0, epoch=1) != orders[0]
    assert rank_order(dataset, 0) == orders[0], "the same for a seed and epoch"

    sampler = PageOrderSampler(dataset, 2, 0, seed=3, streams=2, batch_size=4, shuffle=True,
                               shuffle_pages=2)  # fmt: skip
    sampler.skip = 12
    assert list(sampler) == orders[0][12:], "an epoch resumed part-way"
    assert list(sampler) == orders[0], "then whole again"

    evaluation = [rank_order(dataset, rank, shuffle=False) for rank in (0, 1)]
    assert sorted(evaluation[0] + evaluation[1]) == list(range(len(dataset) // 2 * 2))


def test_each_loader_process_reads_its_own_pages_once(prepared: Path, server: RangeServer) -> None:
    """An epoch of training batches from 2 loader processes fetches the bytes of the windows it
    trains on about once (every process reading every page would fetch them twice)."""
    module = streamed(f"{server.url}/tokens", read_mb=0.002, num_workers=2, batch_size=4)
    loader = module.train_dataloader()
    manifest = read_manifest(prepared)
    train_files = {shard["file"] for shard in manifest["splits"]["train"]["shards"]}
    server.sent.clear()
    batches = [inputs for inputs, _ in loader]
    fetched = sum(server.sent[name] for name in train_files)
    trained = sum(batch.numel() for batch in batches) * 2  # uint16 tokens
    assert len(batches) == len(loader) > 10
    assert trained <= fetched < 1.3 * trained, (fetched, trained)


def test_bad_urls_and_remote_folders_get_one_line(prepared: Path, server: RangeServer,
                                                  tmp_path: Path) -> None:  # fmt: skip
    for url in ("https://reader:s3cret@example.com/tokens", "s3://bucket/tokens?token=s3cret",
                "gs://bucket/tokens#s3cret"):  # fmt: skip
        with pytest.raises(ConfigError, match="may carry credentials") as refused:
            TokenShardDataModule(url, vocab_size=300)
        assert "s3cret" not in str(refused.value)
    with pytest.raises(ConfigError, match="Protocol not known: nosuch"):
        TokenShardDataModule("nosuch://bucket/tokens", vocab_size=300)
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(ConfigError, match=r"s3://bucket/tokens: Install s3fs .*pip install"):
            TokenShardDataModule("s3://bucket/tokens", vocab_size=300)
    with pytest.raises(ConfigError, match=r"has no manifest\.json"):
        TokenShardDataModule(f"{server.url}/missing", vocab_size=300)
    closed = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    port = closed.server_address[1]
    closed.server_close()
    with pytest.raises(ConfigError, match=r"could not read manifest\.json.*credentials"):
        TokenShardDataModule(f"http://127.0.0.1:{port}/tokens", vocab_size=300)

    truncated = Path(shutil.copytree(prepared, prepared.parent / "truncated"))
    shard = truncated / read_manifest(truncated)["splits"]["val"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"val-00000\.bin has \d+ bytes, not \d+"):
        streamed(f"{server.url}/truncated")
    with pytest.raises(ConfigError, match="fewer than one batch of 100000"):
        streamed(prepared.as_uri(), batch_size=100000).train_dataloader()
    with pytest.raises(ConfigError, match=r"data\.read_mb=0"):
        TokenShardDataModule(prepared.as_uri(), vocab_size=300, read_mb=0)


def test_a_shard_cut_during_a_run_is_named_in_one_line(prepared: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(prepared, tmp_path / "tokens"))
    module = streamed(folder.as_uri(), read_mb=0.001, num_workers=2, batch_size=4)
    loader = module.train_dataloader()
    for shard in read_manifest(folder)["splits"]["train"]["shards"]:
        (folder / shard["file"]).write_bytes(b"")
    with pytest.raises(ConfigError) as cut:
        next(iter(loader))
    line = without_worker_trace(str(cut.value))
    assert "\n" not in line and line.endswith("start a new run."), line
    assert re.search(r"/train-\d+\.bin gave 0 bytes where \d+ were asked for", line), line


def test_a_busy_server_is_tried_again_and_one_that_ignores_ranges_is_one_line(
    prepared: Path, server: RangeServer
) -> None:
    local = TokenShardDataModule(str(prepared), vocab_size=300, block_size=16)
    local.setup("fit")
    module = streamed(f"{server.url}/tokens", read_mb=0.001)
    server.faults["busy"] = 2
    assert all(map(torch.equal, module.splits["val"][40], local.splits["val"][40]))
    assert server.faults["busy"] == 0, "both refusals were met, then the read went through"

    server.faults["busy"] = 10
    with pytest.raises(ConfigError, match=r"could not read .*/val-00000\.bin after 4 tries"):
        module.splits["val"][0]
    server.faults["busy"] = 0

    server.faults["whole"] = 1
    try:
        with pytest.raises(ConfigError, match=r"gave .* bytes where .* its server ignores byte"):
            module.splits["test"][0]
    finally:
        server.faults["whole"] = 0


def test_a_url_with_credentials_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "experiment=language_bpe", "trainer=cpu",
        "data.path=https://reader:s3cret@example.com/tokens", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert (
        line.startswith("error: data.path=https://example.com/tokens...") and "s3cret" not in line
    )
    assert list(tmp_path.iterdir()) == [], "no run directory, no saved config"


@pytest.mark.slow
def test_a_streamed_run_on_two_ranks_killed_mid_epoch_finishes_exactly(
    prepared: Path, tmp_path: Path, reference_run: References
) -> None:
    command = [
        *shard_run(prepared.as_uri()), "data.read_mb=0.004", "strategy=ddp", "trainer.devices=2",
    ]  # fmt: skip
    killed_then_finished([*command, *fault("train_step", 6, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(command), tmp_path / "run")
