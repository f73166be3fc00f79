"""The prepare command and the token-shard data module: a tokenizer that gives text back exactly,
shards that hold exactly the corpus's tokens, windows split across ranks, exact resume after a
kill, one line for each bad input (before the corpus is read), and nothing but the corpus read."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from {{ cookiecutter.package_name }}.cli import _run
from {{ cookiecutter.package_name }}.data.base import (
    ResumableSampler,
)
from {{ cookiecutter.package_name }}.data.token_shards import (
    MANIFEST,
    SPLITS,
    TokenShardDataModule,
    read_manifest,
)
from {{ cookiecutter.package_name }}.data.tokenizer import (
    END_OF_TEXT,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    tokenizer_file,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.prepare import (
    corpus_pieces,
    prepare,
    shards,
    split_pieces,
)

from .helpers import PACKAGE, compose_config, run_cli
from .killing import (
    COMMON,
    References,
    assert_same_outcome,
    fault,
    killed_then_finished,
    run,
    run_dir,
)

HARD_TEXT = "def été(x):\n    return x  # ünïcödé, emoji \U0001f600, tab\t, NUL \x00 and CRLF\r\n"


def write_corpus(folder: Path, files: int = 30) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        lines = [
            f"def function_{index}_{line}(value):\n    return value * {line}\n"
            for line in range(40)
        ]
        (folder / f"module_{index:02d}.py").write_text("".join(lines) + HARD_TEXT)
    return folder


# The `prepared` fixture's settings besides its source.
PREPARED = ["vocab_size=300", "shard_tokens=2000", "val_fraction=0.1", "test_fraction=0.1"]
# Cheap to prepare: byte tokens, one worker.
QUICK = ["tokenizer=bytes", "workers=1", "val_fraction=0.1", "test_fraction=0.1"]


def prepare_config(tmp_path: Path, *overrides: str) -> DictConfig:
    return compose_config(
        "prepare", [f"output={tmp_path / 'tokens'}", "workers=2", *overrides], tmp_path
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE of 300 tokens, in shards of 2,000 tokens (several per split)."""
    folder = tmp_path_factory.mktemp("prepared")
    prepare(prepare_config(folder, f"source={corpus}", *PREPARED))
    return folder / "tokens"


def read_split(folder: Path, manifest: dict[str, Any], split: str) -> np.ndarray[Any, Any]:
    files = [folder / shard["file"] for shard in manifest["splits"][split]["shards"]]
    return np.concatenate([np.fromfile(path, dtype=manifest["dtype"]) for path in files])


def test_both_tokenizers_give_text_back_exactly(corpus: Path) -> None:
    texts = [path.read_text() for path in sorted(corpus.iterdir())]
    bpe = BPETokenizer.train(texts, vocab_size=300)
    unseen = HARD_TEXT + "class Ωmega: pass\n"
    for tokenizer in (bpe, ByteTokenizer()):
        ids = tokenizer.encode(unseen)
        assert tokenizer.decode(ids) == unseen
        assert max(ids) < tokenizer.vocab_size and tokenizer.end_of_text not in ids
    assert len(bpe.encode(texts[0])) < len(texts[0].encode()) / 2, "BPE merges common text"


def test_shards_hold_exactly_the_corpus_tokens(corpus: Path, prepared: Path) -> None:
    manifest = read_manifest(prepared)
    tokenizer = load_tokenizer(prepared / manifest["tokenizer"])
    pieces = split_pieces(str(corpus), 4_000_000, 0.1, 0.1)
    for split in ("train", "val", "test"):
        counts = manifest["splits"][split]
        assert len(counts["shards"]) >= (2 if split == "train" else 1)
        tokens = read_split(prepared, manifest, split)
        assert len(tokens) == counts["tokens"]
        expected = np.concatenate(
            [np.asarray([*tokenizer.encode(p), tokenizer.end_of_text]) for p in pieces[split]]
        )
        assert np.array_equal(tokens, expected), split
        ends = np.flatnonzero(tokens == tokenizer.end_of_text)
        decoded = [tokenizer.decode(part.tolist()) for part in np.split(tokens, ends + 1)[:-1]]
        assert decoded == pieces[split]
        assert counts["bytes"] == sum(len(p.encode()) for p in pieces[split])
    assert manifest["dtype"] == "<u2"


def test_windows_are_slices_of_the_stream_and_disjoint_across_ranks(prepared: Path) -> None:
    module = TokenShardDataModule(str(prepared), vocab_size=300, block_size=64)
    module.setup("fit")
    train = module.splits["train"]
    stream = torch.from_numpy(read_split(prepared, module.manifest, "train").astype(np.int64))
    for index in range(len(train)):  # includes windows that cross a shard boundary
        inputs, targets = train[index]
        assert torch.equal(inputs, stream[index * 64 : index * 64 + 64])
        assert torch.equal(targets, stream[index * 64 + 1 : index * 64 + 65])
    ranks = [set(ResumableSampler(train, 2, rank, seed=3)) for rank in (0, 1)]
    assert ranks[0] and not ranks[0] & ranks[1]
    assert len(ranks[0] | ranks[1]) == len(train) // 2 * 2


def test_bits_per_byte_uses_the_split_s_bytes_per_token(prepared: Path) -> None:
    module = TokenShardDataModule(str(prepared), vocab_size=300)
    counts = module.manifest["splits"]["val"]
    assert module.tokens_per_byte("val") == counts["tokens"] / counts["bytes"] < 1


def test_a_prepared_folder_is_reused_only_with_the_same_settings(
    corpus: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However the source is written; the shard size is one of the settings."""
    stamp = (prepared / MANIFEST).stat().st_mtime_ns
    monkeypatch.chdir(corpus.parent)
    name = corpus.name
    for source in (corpus, name, f"./{name}", f"{name}/", f"{name}/../{name}"):
        again = prepare_config(prepared.parent, f"source={source}", *PREPARED)
        assert prepare(again)["splits"] == read_manifest(prepared)["splits"]
    assert (prepared / MANIFEST).stat().st_mtime_ns == stamp, "nothing was written again"
    for setting in ("vocab_size=400", "shard_tokens=4000"):
        other = prepare_config(prepared.parent, f"source={corpus}", *PREPARED, setting)
        key = setting.split("=")[0]
        with pytest.raises(ConfigError, match=rf"other settings \({key} differ\)"):
            prepare(other)


def test_a_vocab_size_that_a_tokenizer_of_bytes_does_not_use_is_no_other_setting(
    corpus: Path, tmp_path: Path
) -> None:
    first = prepare(prepare_config(tmp_path, f"source={corpus}", *QUICK))
    stamp = (tmp_path / "tokens" / MANIFEST).stat().st_mtime_ns
    again = prepare(prepare_config(tmp_path, f"source={corpus}", *QUICK, "vocab_size=1000"))
    assert again == first and (tmp_path / "tokens" / MANIFEST).stat().st_mtime_ns == stamp
    other = prepare_config(tmp_path, f"source={corpus}", *QUICK, "shard_tokens=123")
    with pytest.raises(ConfigError, match=r"other settings \(shard_tokens differ\)"):
        prepare(other)


BAD_PREPARE = {
    "empty corpus": (["source={empty}"], "holds no text"),
    "glob matching nothing": (["source={tmp}/nothing/*.txt"], "matches no files"),
    "missing source": (["source={tmp}/nothing"], "source={tmp}/nothing is neither a file"),
    "empty folder": (["source={tmp}/hollow"], "source={tmp}/hollow is a folder with no files"),
    "missing tokenizer file": (["tokenizer={tmp}/missing.json"], "use bpe, bytes, or the path"),
    "vocabulary too small": (["vocab_size=10"], "vocab_size=10"),
}


@pytest.mark.parametrize("case", list(BAD_PREPARE))
def test_bad_prepare_input_gets_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "hollow").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    overrides, message = BAD_PREPARE[case]
    filled = [o.format(empty=tmp_path / "empty", tmp=tmp_path) for o in overrides]
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import prepare; prepare()", *filled,
        f"output={tmp_path / 'tokens'}", "extras.print_config=false", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "tokens").exists() and not list(tmp_path.glob(".tokens*"))


def backtracking_tokenizer(path: Path) -> Path:
    """A tokenizer.json whose pre-tokenizer's regular expression backtracks past Oniguruma's
    limit on a long run of one letter: the tokenizers library panics (a BaseException)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "c": 1, END_OF_TEXT: 2}, merges=[]))
    tokenizer.add_special_tokens([END_OF_TEXT])
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"(a+)+(?=b)"), "isolated")
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_that_panics_is_one_line(tmp_path: Path) -> None:
    """Its panic on a text is the tokenizer's one line, in prepare's workers as in the process,
    not a worker that 'ended before it answered' nor a traceback."""
    path = backtracking_tokenizer(tmp_path / "backtracks.json")
    tokenizer = tokenizer_file("data.tokenizer", str(path), "give another")
    assert tokenizer.encode("ac") == [0, 1]
    with pytest.raises(ConfigError, match="the tokenizer cannot encode this text"):
        tokenizer.encode("a" * 5000 + "c")
    (tmp_path / "corpus").mkdir()
    for index in range(10):
        (tmp_path / "corpus" / f"{index}.txt").write_text("a" * 5000 + "c\n")
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import prepare; prepare()", f"source={tmp_path / 'corpus'}",
        f"tokenizer={path}", f"output={tmp_path / 'tokens'}", "extras.print_config=false",
        "val_fraction=0.3", "test_fraction=0.3", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "the tokenizer cannot encode" in last, last
    assert "Traceback" not in result.stderr and "ended before it answered" not in last
    assert not (tmp_path / "tokens").exists() and not list(tmp_path.glob(".tokens*"))


BAD_PREPARE_SETTINGS = {
    "source not set": (["source="], ["source is not set"]),
    "source null": (["source=null"], ["source is not set"]),
    "output not set": (["output="], ["output is not set"]),
    "output inside a file": (["output={tmp}/blank.txt/tokens"], ["blank.txt/tokens", "a file"]),
    "workers negative": (["workers=-1"], ["workers=-1", "1 or more, or null"]),
    "workers zero": (["workers=0"], ["workers=0", "1 or more"]),
    "val_fraction above 1": (["val_fraction=1.5"], ["val_fraction=1.5", "above 0 and below 1"]),
    "val_fraction zero": (["val_fraction=0"], ["val_fraction=0", "above 0"]),
    "test_fraction negative": (["test_fraction=-0.1"], ["test_fraction=-0.1", "above 0"]),
    "test_fraction not a number": (["test_fraction=nan"], ["test_fraction=nan"]),
    "fractions leaving no training text": (
        ["val_fraction=0.6", "test_fraction=0.5"],
        ["val_fraction=0.6", "test_fraction=0.5", "below 1"],
    ),
    "max_bytes zero": (["max_bytes=0"], ["max_bytes=0"]),
    "vocab_size too small": (["vocab_size=10"], ["vocab_size=10", "from 257 to"]),
    "shard_tokens zero": (["shard_tokens=0"], ["shard_tokens=0", "1 or more"]),
    "shard_tokens null": (["shard_tokens=null"], ["shard_tokens=None", "1 or more"]),
    "tokenizer file missing": (["tokenizer={tmp}/missing.json"], ["use bpe, bytes, or the path"]),
    "source a file with no text": (["source={tmp}/blank.txt"], ["holds no text"]),
    "source only hidden files": (["source={tmp}/hidden"], ["no files in it"]),
    "source a file that is not UTF-8": (["source={tmp}/latin1.txt"], ["latin1.txt is not UTF-8 text", "iconv"]),
    "source a folder of binaries": (["source={tmp}/binaries"], ["holds no text", "2 files are not UTF-8"]),
    "source a folder of token shards": (["source={tmp}/shards"], ["is a folder of token shards", "data.path="]),
}  # fmt: skip


def one_line_error(cfg: DictConfig, capsys: pytest.CaptureFixture[str]) -> str:
    """Run as the command line does: exit code 1 and one `error:` line on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _run(prepare, cfg)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def files_in(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.mark.parametrize("case", list(BAD_PREPARE_SETTINGS))
def test_bad_prepare_settings_get_one_line_before_the_corpus_is_read(
    case: str, corpus: Path, prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    shutil.copytree(prepared, tmp_path / "shards")
    (tmp_path / "blank.txt").write_text("\n \n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    (tmp_path / "binaries").mkdir()
    (tmp_path / "binaries" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 10)
    (tmp_path / "binaries" / "b.pyc").write_bytes(bytes(range(256)))
    (tmp_path / "hidden" / ".git").mkdir(parents=True)
    (tmp_path / "hidden" / ".notes.txt").write_text("hidden text\n")
    (tmp_path / "hidden" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = files_in(tmp_path)
    overrides, fragments = BAD_PREPARE_SETTINGS[case]
    filled = [override.format(tmp=tmp_path) for override in overrides]
    cfg = prepare_config(tmp_path, f"source={corpus}", *filled)
    monkeypatch.chdir(tmp_path)  # where an unset source or output would point
    if not case.startswith("source "):
        monkeypatch.setattr(corpus_pieces, "source_files", lambda *_: pytest.fail("read"))
    line = one_line_error(cfg, capsys)
    for fragment in fragments:
        assert fragment in line, line
    assert files_in(tmp_path) == before, "nothing is written"


@pytest.mark.parametrize("pattern", ["{corpus}", "{corpus}/**/*"])
def test_an_output_inside_the_corpus_is_not_read_as_corpus(
    pattern: str, corpus: Path, prepared: Path, tmp_path: Path
) -> None:
    """A killed run's staging folder, an earlier output, and hidden files are not corpus."""
    inside = Path(shutil.copytree(corpus, tmp_path / "corpus"))
    shutil.copytree(prepared, inside / "earlier-tokens")
    staging = inside / ".tokens.tmp-prepare"
    staging.mkdir()
    (staging / "tokenizer.json").write_text('{"left": "by a killed run"}\n' * 100)
    (inside / ".notes.txt").write_text("hidden\n" * 100)
    text_bytes = sum(path.stat().st_size for path in corpus.iterdir())
    source = f"source={pattern.format(corpus=inside)}"
    for output in ("tokens", "more-tokens"):  # the first output lies in the corpus too
        manifest = prepare(prepare_config(inside, source, *QUICK, f"output={inside / output}"))
        assert sum(manifest["splits"][split]["bytes"] for split in SPLITS) == text_bytes


def test_files_that_are_not_utf8_text_are_left_out_with_a_warning(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mixed = Path(shutil.copytree(corpus, tmp_path / "mixed"))
    (mixed / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (mixed / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1") * 50)
    text_bytes = sum(path.stat().st_size for path in corpus.iterdir())
    manifest = prepare(prepare_config(tmp_path, f"source={mixed}", *QUICK))
    assert sum(manifest["splits"][split]["bytes"] for split in SPLITS) == text_bytes
    assert "Left out 2 file(s)" in caplog.text and "image.png" in caplog.text


def test_max_bytes_reads_only_what_it_keeps_and_cuts_as_the_whole_corpus_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last piece kept ends where it would in the whole file, and no later file is opened."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    line = "r\u00e9sum\u00e9 \U0001f600 " * 7 + "\n"
    (folder / "a_large.txt").write_text(line * 20_000)  # about 3 MB, 40 pieces
    for index in range(5):
        (folder / f"b_{index}.txt").write_text(line * 100)
    read: list[tuple[str, int]] = []
    read_text = corpus_pieces.read_text

    def counted(path: Path, limit: int | None, source: str) -> str | None:
        text = read_text(path, limit, source)
        read.append((path.name, len((text or "").encode())))
        return text

    whole = split_pieces(str(folder), None, 0.1, 0.1)
    monkeypatch.setattr(corpus_pieces, "read_text", counted)
    kept = split_pieces(str(folder), 1_500_000, 0.1, 0.1)
    for split in SPLITS:
        assert kept[split] == whole[split][: len(kept[split])]
    assert 1_500_000 <= sum(len(p.encode()) for pieces in kept.values() for p in pieces) < 1_800_000
    assert [name for name, _ in read] == ["a_large.txt"]
    assert read[0][1] <= 1_500_000 + 4 * corpus_pieces.PIECE_CHARACTERS + 4


def test_a_prepare_failing_while_writing_leaves_no_staging_folder(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    def disk_full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.bin"))

    monkeypatch.setattr(shards, "tokenize_split", disk_full)
    cfg = prepare_config(tmp_path, f"source={corpus}", *QUICK)
    assert "No space left" in one_line_error(cfg, capsys)
    assert files_in(tmp_path) == []


def first_shard(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["splits"]["train"]["shards"][0]  # type: ignore[no-any-return]


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "copy"))


def test_a_shard_folder_is_read_only_inside_itself(prepared: Path, tmp_path: Path) -> None:
    """A shard or tokenizer that links out of the folder, however right its recorded size and
    SHA-256, and a shard that is a pipe, are refused before they are opened."""
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = copy_of(prepared, tmp_path / "linked")
    shard = linked / first_shard(read_manifest(linked))["file"]
    shard.rename(outside / shard.name)
    shard.symlink_to(outside / shard.name)
    with pytest.raises(ConfigError, match=rf"{shard.name} is a link to a file outside the folder"):
        TokenShardDataModule(str(linked), vocab_size=300).setup("fit")

    tokenizer = copy_of(prepared, tmp_path / "tokenizer")
    (tokenizer / "tokenizer.json").rename(outside / "tokenizer.json")
    (tokenizer / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json is a link to a file outside"):
        TokenShardDataModule(str(tokenizer), vocab_size=300).load_tokenizer()

    piped = copy_of(prepared, tmp_path / "piped")
    shard = piped / first_shard(read_manifest(piped))["file"]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(ConfigError, match=rf"{shard.name} is not a regular file"):
        TokenShardDataModule(str(piped), vocab_size=300).setup("fit")  # opened, it would block


@pytest.mark.parametrize("checksums", [True, False])
def test_token_ids_past_the_vocabulary_are_one_line(
    prepared: Path, tmp_path: Path, checksums: bool
) -> None:
    """A shard from another tokenizer, its manifest right: found by the checksum pass before
    training, or, without checksums, by the window that holds the id (not an IndexError)."""
    folder = copy_of(prepared, tmp_path / "other_tokenizer")
    manifest = read_manifest(folder)
    record = first_shard(manifest)
    shard = folder / record["file"]
    tokens = np.fromfile(shard, dtype=manifest["dtype"])
    tokens[:] = 299
    tokens[0] = 299 + 1000
    tokens.tofile(shard)
    record["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    data = TokenShardDataModule(str(folder), vocab_size=300, verify_checksums=checksums)
    with pytest.raises(ConfigError, match=r"token id 1299, past the model's vocabulary of 300"):
        data.setup("fit")
        data.splits["train"][0]


def test_bad_shard_folders_get_one_line(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no manifest\.json.*prepare") as refused:
        TokenShardDataModule(str(tmp_path), vocab_size=300)
    assert "<" not in str(refused.value), "no placeholder for the command's name"
    with pytest.raises(
        ConfigError, match=r"data\.vocab_size=200 is smaller than the tokenizer's 300"
    ):
        TokenShardDataModule(str(prepared), vocab_size=200)

    truncated = copy_of(prepared, tmp_path / "truncated")
    shard = truncated / read_manifest(truncated)["splits"]["val"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"val-00000\.bin has \d+ bytes, not \d+"):
        TokenShardDataModule(str(truncated), vocab_size=300).setup("fit")

    flipped = copy_of(prepared, tmp_path / "flipped")
    shard = flipped / read_manifest(flipped)["splits"]["train"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"does not match its SHA-256"):
        TokenShardDataModule(str(flipped), vocab_size=300).setup("fit")

    escaping = copy_of(prepared, tmp_path / "escaping")
    manifest = read_manifest(escaping)
    manifest["splits"]["val"]["shards"][0]["file"] = "../../outside.bin"
    (escaping / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"is not a file in the folder"):
        TokenShardDataModule(str(escaping), vocab_size=300)

    garbled = copy_of(prepared, tmp_path / "garbled")
    (garbled / MANIFEST).write_text(json.dumps({"format": 1}))
    with pytest.raises(ConfigError, match=r"is not a manifest of this project's token shards"):
        TokenShardDataModule(str(garbled), vocab_size=300)

    tampered: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
        "object dtype": (lambda m: m.update(dtype="|O"), "dtype '|O'"),
        "float dtype": (lambda m: m.update(dtype="<f8"), "dtype '<f8'"),
        "no vocabulary": (lambda m: m.update(vocab_size=0), "vocab_size 0"),
        "a vocabulary past uint32": (lambda m: m.update(vocab_size=2**40), "vocab_size"),
        "negative tokens": (lambda m: first_shard(m).update(tokens=-5), "count of tokens"),
        "tokens as text": (lambda m: first_shard(m).update(tokens="many"), "count of tokens"),
        "no checksum": (lambda m: first_shard(m).pop("sha256"), "sha256"),
    }
    for case, (tamper, named) in tampered.items():
        folder = copy_of(prepared, tmp_path / case.replace(" ", "_"))
        manifest = read_manifest(folder)
        tamper(manifest)
        (folder / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match="is not a manifest of this") as refused:
            TokenShardDataModule(str(folder), vocab_size=300)
        assert named in str(refused.value), case

    for name, tokenizer in (("no_tokenizer", None), ("bad_tokenizer", "garbage")):
        folder = copy_of(prepared, tmp_path / name)
        if tokenizer is None:
            (folder / "tokenizer.json").unlink()
        else:
            (folder / "tokenizer.json").write_text(tokenizer)
        with pytest.raises(ConfigError, match=r"tokenizer\.json (is missing|is not a tokenizer)"):
            TokenShardDataModule(str(folder), vocab_size=300).setup("fit")


def shard_run(path: str) -> list[str]:
    """The tiny GPT on shards of a 300-token BPE, two loader workers: a validation and a step
    checkpoint every 4 steps, early stopping at step 8 of 12 (tests/killing.py)."""
    return [
        *COMMON, "experiment=language_bpe", f"data.path={path}", "data.vocab_size=304",
        "data.block_size=32", "data.batch_size=4", "model.net.n_layer=1", "trainer.max_steps=12",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
        "data.num_workers=2",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_on_token_shards_killed_mid_epoch_finishes_exactly(
    prepared: Path, tmp_path: Path, reference_run: References
) -> None:
    command = shard_run(str(prepared))
    killed_then_finished([*command, *fault("train_step", 6, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(command), tmp_path / "run")

    # The trained model continues a prompt through the shards' tokenizer, streaming the text.
    last = run_dir(tmp_path / "run") / "checkpoints" / "last.ckpt"
    code, output = run(
        [f"ckpt_path={last}", "prompt=def été(", "max_new_tokens=20", "trainer=cpu"],
        tmp_path / "predict", entry="predict",
    )  # fmt: skip
    assert code == 0, output[-3000:]
    (written,) = (tmp_path / "predict" / "logs" / "predict" / "runs").glob("*/predictions.jsonl")
    (line,) = written.read_text().splitlines()
    completion = json.loads(line)["completion"]
    assert completion and f"def été({completion}" in output


def test_a_run_on_token_shards_resumed_at_an_epoch_s_start_finishes_exactly(
    prepared: Path, tmp_path: Path, reference_run: References
) -> None:
    """Epochs of four batches, each ending in a validation and its checkpoints; killed in epoch
    1's first step, the run resumes from epoch 0's end. Lightning makes the loader's iterator
    before it sets the resumed epoch on the sampler, and the loader processes drew their order
    then: epoch 1 trained on epoch 0's batches."""
    steps = ("trainer.max_steps=", "trainer.val_check_interval=")
    command = [
        *(arg for arg in shard_run(str(prepared)) if not arg.startswith(steps)),
        "trainer.max_steps=-1", "trainer.max_epochs=3", "trainer.limit_train_batches=4",
        "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=1",
    ]  # fmt: skip
    killed_then_finished([*command, *fault("train_step", 5, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(command), tmp_path / "run")


@pytest.mark.slow
def test_a_killed_prepare_leaves_nothing_that_looks_prepared_and_the_same_command_finishes(
    corpus: Path, prepared: Path, tmp_path: Path
) -> None:
    """Killed while the workers tokenize: no output folder, and the same command then writes
    exactly what an uninterrupted one wrote (the `prepared` fixture's settings)."""
    command = [
        sys.executable, "-c", f"from {PACKAGE}.cli import prepare; prepare()",
        f"source={corpus}", "vocab_size=300", "shard_tokens=2000", "val_fraction=0.1",
        "test_fraction=0.1", f"output={tmp_path / 'tokens'}", "workers=2",
        "extras.print_config=false",
    ]  # fmt: skip
    staging = tmp_path / ".tokens.tmp-prepare"
    process = subprocess.Popen(command, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (staging / "tokenizer.json").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "prepare never started writing"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "tokens").exists()
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert not staging.exists()
    assert read_manifest(tmp_path / "tokens")["splits"] == read_manifest(prepared)["splits"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")
@pytest.mark.parametrize("killed", ["after the worker started", "while the worker starts"])
def test_a_tokenizer_worker_ends_when_the_command_is_killed_alone(killed: str) -> None:
    """prepare's workers call die_with_parent: a SIGKILL to the command's process alone (as the
    out-of-memory killer sends, not to its group) ends them too, also one that was still
    starting."""
    delay = 0 if killed.startswith("after") else 3
    worker = (
        f"import os, time; time.sleep({delay}); from {PACKAGE}.data.tokenizing_worker import die_with_parent; "
        "die_with_parent(int(os.environ['PARENT'])); print('ready', flush=True); time.sleep(600)"
    )
    command = (
        "import os, subprocess, sys, time; os.environ['PARENT'] = str(os.getpid()); "
        f"child = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE); "
        "print(child.pid, flush=True); print(child.stdout.readline().decode().strip(), "
        "flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", command], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    if delay == 0:
        assert parent.stdout.readline().strip() == "ready"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while alive(child):
        assert time.monotonic() < deadline, "the worker outlived the command"
        time.sleep(0.1)
