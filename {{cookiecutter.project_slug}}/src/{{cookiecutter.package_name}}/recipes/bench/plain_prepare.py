"""A plain `tokenizers` + numpy script that writes the same token shards (and `tokenizer.json`) as
the prepare command, byte for byte, without this project: the baseline that `bench.prepare=true`
times the command against. It is run as a file (`python plain_prepare.py SOURCE OUTPUT ...`), so
it imports the standard library, numpy and `tokenizers` and nothing else; the tokenizer encodes
each split in one batch call, parallel on every core. It writes no manifest.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

PIECE_CHARACTERS = 64 * 1024
GOLDEN_RATIO = 0.6180339887498949
END_OF_TEXT = "<|endoftext|>"


def files_of(source: str) -> list[Path]:
    """`stdlib`, a glob, a folder (its files that are not hidden, sorted) or a file."""
    if source == "stdlib":
        found: list[Path] = []  # not the installed packages under site-packages
        for folder, folders, names in os.walk(sysconfig.get_paths()["stdlib"]):
            folders[:] = [name for name in folders if name != "site-packages"]
            found += [Path(folder) / name for name in names if name.endswith(".py")]
        return sorted(path for path in found if path.is_file())
    if any(character in source for character in "*?["):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        return [path for path in found if path.is_file()]
    if Path(source).is_dir():
        files = []
        for root, folders, names in os.walk(source):
            folders[:] = [name for name in folders if not name.startswith(".")]
            files += [
                Path(root) / n
                for n in names
                if not n.startswith(".") and (Path(root) / n).is_file()
            ]
        return sorted(files)
    return [Path(source)]


def cut(text: str) -> list[str]:
    pieces = []
    while len(text) > PIECE_CHARACTERS:
        end = text.rfind("\n", 0, PIECE_CHARACTERS) + 1 or PIECE_CHARACTERS
        pieces.append(text[:end])
        text = text[end:]
    return [*pieces, text] if text else pieces


def split_pieces(
    files: list[Path], max_bytes: int | None, val_fraction: float, test_fraction: float
) -> dict[str, list[str]]:
    pieces: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    total, index = 0, 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        with path.open("rb") as file:
            if max_bytes is None:
                data, complete = file.read(), True
            else:
                data = file.read(max_bytes - total + 4 * PIECE_CHARACTERS + 4)
                complete = not file.read(1)
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
        except UnicodeDecodeError:
            continue
        for piece in cut(text):
            if max_bytes is not None and total >= max_bytes:
                break
            position = (index * GOLDEN_RATIO) % 1.0
            split = (
                "val" if position < val_fraction
                else "test" if position < val_fraction + test_fraction
                else "train"
            )  # fmt: skip
            pieces[split].append(piece)
            total += len(piece.encode("utf-8"))
            index += 1
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("output", type=Path)
    parser.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--test-fraction", type=float, default=0.05)
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    args = parser.parse_args()
    pieces = split_pieces(
        files_of(args.source), args.max_bytes, args.val_fraction, args.test_fraction
    )
    args.output.mkdir(parents=True, exist_ok=True)
    dtype: np.dtype[Any] = np.dtype("<u2")
    if args.tokenizer == "bytes":
        end_of_text = 256
        (args.output / "tokenizer.json").write_text('{"type": "bytes"}\n')
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=args.vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(pieces["train"], trainer=trainer)
        tokenizer.save(str(args.output / "tokenizer.json"))
        vocab_size = tokenizer.get_vocab_size()
        dtype = np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
        special = tokenizer.token_to_id(END_OF_TEXT)
        assert special is not None, "the trainer adds the special token"
        end_of_text = special
        encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for split, texts in pieces.items():
        ids: list[Any]
        if args.tokenizer == "bytes":
            ids = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        else:
            ids = [encoding.ids for encoding in encode_batch(texts, add_special_tokens=False)]
        end = np.asarray([end_of_text], dtype=dtype)
        tokens = np.concatenate([part for piece in ids for part in (np.asarray(piece, dtype), end)])
        for number, start in enumerate(range(0, len(tokens), args.shard_tokens)):
            shard = tokens[start : start + args.shard_tokens]
            shard.tofile(args.output / f"{split}-{number:05d}.bin")


if __name__ == "__main__":
    main()
