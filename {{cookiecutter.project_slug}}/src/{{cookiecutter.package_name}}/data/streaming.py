"""Token shards read from a URL (s3://, gs://, az://, hf://, https://, file://) in ranges, with
nothing written to disk: a data set bigger than the disk trains as it streams.

fsspec reads the files (its s3fs, gcsfs, adlfs... backends take credentials from the environment,
as their SDKs do). A URL that could carry credentials itself is refused: the run's config, which
holds it, is saved with the run.

The windows are grouped in pages (runs of whole windows, about `read_mb` each, read with one
request). Each epoch, `PageOrderSampler` shuffles the pages, deals them to the ranks and to each
rank's loader processes, and shuffles the windows within a few pages at a time. Each loader
process keeps those few pages in memory, so a page is read once an epoch, by one process.
"""

from __future__ import annotations

import itertools
import math
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from torch.utils.data import Dataset

from .base import ResumableSampler
from .errors import ConfigError

READ_ATTEMPTS = 4


def is_url(path: str) -> bool:
    return "://" in path


def redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{parts.path}"


def check_url(url: str, setting: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(
            f"{setting}={redacted(url)}...: a URL with a user name, password or query may carry "
            "credentials, and the run's config is saved with it. Give the URL of the folder "
            "alone and the credentials in the environment (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...)."
        )


def filesystem(url: str, setting: str) -> tuple[AbstractFileSystem, str]:
    """The file system of `url` (its backend loaded) and the path in it."""
    check_url(url, setting)
    try:
        fs, root = url_to_fs(url)
    except ImportError as error:  # e.g. "Install s3fs to access S3"
        raise ConfigError(f"{setting}={url}: {error} (pip install it).") from error
    except ValueError as error:  # e.g. "Protocol not known: foo"
        raise ConfigError(f"{setting}={url}: {error}.") from error
    return fs, str(root).rstrip("/")


class ShardFolder:
    """A folder of token shards behind a URL: its small files read whole, its shards sized."""

    def __init__(self, url: str, setting: str = "data.path") -> None:
        self.url, self.setting = url.rstrip("/"), setting
        self.fs, self.root = filesystem(url, setting)

    def file_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read_text(self, name: str) -> str | None:
        """The file's text, or None where it does not exist."""
        path = f"{self.root}/{name}"
        try:
            return bytes(self.fs.cat_file(path)).decode()
        except FileNotFoundError:
            return None
        except Exception as error:  # every backend has its own errors; all end the run here
            raise self.unreadable(name, error) from error

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(f"{self.root}/{name}"))
        except FileNotFoundError:
            return None
        except Exception as error:
            raise self.unreadable(name, error) from error

    def unreadable(self, name: str, error: Exception) -> ConfigError:
        return ConfigError(
            f"{self.setting}={self.url}: could not read {name} ({type(error).__name__}: "
            f"{error}). Check the URL, the network and the credentials in the environment."
        )


def spans(starts: np.ndarray[Any, Any], start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """(shard, offset in it, count) for tokens [start, stop) of shards that begin at `starts`."""
    shard = int(np.searchsorted(starts, start, side="right")) - 1
    while start < stop:
        end = min(stop, int(starts[shard + 1]))
        yield shard, start - int(starts[shard]), end - start
        start, shard = end, shard + 1


class StreamedWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: tokens [i*block, (i+1)*block] of the split's shards, read as one stream, as input
    and the same shifted by one as target; read a page (`page_windows` windows) at a time, the
    last `cached_pages` pages kept in memory. Each process opens the file system itself."""

    def __init__(
        self,
        urls: list[str],
        counts: list[int],
        dtype: str,
        block_size: int,
        read_bytes: int,
        cached_pages: int,
    ) -> None:
        self.urls, self.dtype, self.block_size = urls, np.dtype(dtype), block_size
        self.starts = np.cumsum([0, *counts])
        self.read_windows = max(1, read_bytes // (block_size * self.dtype.itemsize))
        self.page_windows = self.read_windows
        self.cached_pages = max(1, cached_pages)
        self.fs: AbstractFileSystem | None = None
        self.paths: list[str] = []
        self.pages: OrderedDict[int, np.ndarray[Any, Any]] = OrderedDict()

    def __len__(self) -> int:
        return max(0, (int(self.starts[-1]) - 1) // self.block_size)

    def fit_pages(self, readers: int) -> None:
        """Pages small enough that each of `readers` (ranks x loader processes) gets one."""
        self.page_windows = max(1, min(self.read_windows, len(self) // max(1, readers)))
        self.pages.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fs": None, "paths": [], "pages": OrderedDict()}

    def read(self, start: int, stop: int) -> np.ndarray[Any, Any]:
        """Tokens [start, stop) of the stream, one ranged read per shard they lie in."""
        itemsize = self.dtype.itemsize
        pieces = []
        for shard, offset, count in spans(self.starts, start, stop):
            data = self.fetch(shard, offset * itemsize, (offset + count) * itemsize)
            if len(data) != count * itemsize:
                raise ConfigError(
                    f"{self.urls[shard]} gave {len(data)} bytes where {count * itemsize} were "
                    "asked for: it changed since the run started, or its server ignores byte "
                    "ranges. Restore it, or prepare the folder again and start a new run."
                )
            pieces.append(np.frombuffer(data, dtype=self.dtype))
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def fetch(self, shard: int, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a shard, tried again after a failure that may pass (a dropped
        connection, a busy server): fsspec's HTTP reader does not retry by itself."""
        if self.fs is None:
            self.fs, _ = url_to_fs(self.urls[0])
            self.paths = [str(url_to_fs(url)[1]) for url in self.urls]
        for attempt in range(READ_ATTEMPTS):
            try:
                return bytes(self.fs.cat_file(self.paths[shard], start, stop))
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as error:  # every backend has its own errors
                if attempt == READ_ATTEMPTS - 1:
                    raise ConfigError(
                        f"could not read {self.urls[shard]} after {READ_ATTEMPTS} tries "
                        f"({type(error).__name__}: {error}). Check the network; the same "
                        "command resumes from the last checkpoint."
                    ) from error
                time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def page(self, number: int) -> np.ndarray[Any, Any]:
        if number in self.pages:
            self.pages.move_to_end(number)
            return self.pages[number]
        first = number * self.page_windows
        last = min(first + self.page_windows, len(self))
        tokens = self.read(first * self.block_size, last * self.block_size + 1)
        self.pages[number] = tokens
        if len(self.pages) > self.cached_pages:
            self.pages.popitem(last=False)
        return tokens

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        page = self.page(index // self.page_windows)
        start = (index % self.page_windows) * self.block_size
        window = torch.from_numpy(page[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def interleave(streams: list[list[int]], batch_size: int) -> list[int]:
    """Batch-sized pieces of each stream in turn (an exhausted stream drops out): the DataLoader
    hands batch j to loader process j mod len(streams), so each process reads only its stream."""
    pieces = [
        [stream[i : i + batch_size] for i in range(0, len(stream), batch_size)]
        for stream in streams
    ]
    order: list[int] = []
    for turn in itertools.zip_longest(*pieces):
        for piece in turn:
            if piece:
                order.extend(piece)
    return order


class PageOrderSampler(ResumableSampler):
    """The order a rank reads a `StreamedWindows` in: resumable part-way through an epoch, like
    the `ResumableSampler` it is, and the same on every run for a seed and epoch.

    Training (`shuffle`): each epoch the whole pages are shuffled and dealt out, the same number
    to every rank (the partial last page, and the fewer than one page per rank left over, sit the
    epoch out); each rank deals its pages to its `streams` loader processes and shuffles each
    stream's windows `shuffle_pages` pages at a time. Evaluation: each rank reads an equal,
    contiguous run of windows in order (fewer than one window per rank left out)."""

    def __init__(
        self,
        dataset: StreamedWindows,
        num_replicas: int,
        rank: int,
        seed: int,
        streams: int,
        batch_size: int,
        shuffle: bool,
        shuffle_pages: int,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, seed)
        self.windows, self.page_windows = len(dataset), dataset.page_windows
        self.streams, self.batch_size = max(1, streams), batch_size
        self.shuffle, self.shuffle_pages = shuffle, max(1, shuffle_pages)

    def __len__(self) -> int:
        if self.shuffle:
            return self.windows // self.page_windows // self.num_replicas * self.page_windows
        return self.windows // self.num_replicas

    def pages(self, generator: torch.Generator) -> list[list[int]]:
        """This rank's pages, as lists of window indices."""
        size = self.page_windows
        if self.shuffle:
            full = self.windows // size
            order = torch.randperm(full, generator=generator).tolist()
            mine = order[: len(self) // size * self.num_replicas][self.rank :: self.num_replicas]
            return [list(range(page * size, page * size + size)) for page in mine]
        first = self.rank * len(self)
        last = first + len(self)
        edges = sorted({first, last, *range(math.ceil(first / size) * size, last, size)})
        return [list(range(a, b)) for a, b in itertools.pairwise(edges)]

    def order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        pages = self.pages(generator)
        streams = []
        for stream in range(self.streams):
            own = pages[stream :: self.streams]
            windows: list[int] = []
            span = self.shuffle_pages if self.shuffle else 1
            for group in range(0, len(own), span):
                run = list(itertools.chain(*own[group : group + span]))
                if self.shuffle:
                    run = [run[i] for i in torch.randperm(len(run), generator=generator)]
                windows.extend(run)
            streams.append(windows)
        return interleave(streams, self.batch_size)

    def __iter__(self) -> Iterator[int]:
        indices = itertools.islice(iter(self.order()), self.skip, None)
        self.skip = 0
        return indices
