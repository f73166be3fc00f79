"""A tokenizing worker process of the prepare command (`data/tokenizing.py` starts and feeds it).

A worker is a fresh interpreter running this module (`python -m <package>.data.tokenizing_worker
<parent pid>`), never a fork of the command: it imports the standard library and the `tokenizers`
library and nothing else (not the torch, Lightning, Hydra or even numpy that the command's own
process may hold), so it is ready in a few hundredths of a second. It ignores SIGINT and SIGTERM
(the command, which a signal to the process group reaches too, ends its workers itself) and is
killed by the kernel when the command ends in any other way (`die_with_parent`).

Over its stdin the command sends frames of an 8-byte little-endian length and that many bytes:
first a JSON object naming the tokenizer's file and the token dtype, then batches of pieces (a
4-byte count, one 8-byte length per piece, the pieces' UTF-8). For each batch the worker answers
on its stdout with one byte (TOKENS, ERROR or REFUSED), an 8-byte length and the batch's token ids
in that dtype, each piece followed by the end-of-text token (ERROR: the error's last line, its
traceback going to stderr; REFUSED: the tokenizer's one line on a text it fails on). A closed
stdin ends it.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import traceback
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from .tokenizer import BPETokenizer, TextTokenizer, TokenizerFailed, load_tokenizer

TOKENS, ERROR, REFUSED = 0, 1, 2  # REFUSED: the tokenizer failed on the text, in one line
LENGTH = struct.Struct("<Q")
ANSWER = struct.Struct("<BQ")
COUNT = struct.Struct("<I")
TYPECODES = {"<u2": "H", "<u4": "I"}  # the shards' dtypes as the array module's


def die_with_parent(parent: int) -> None:
    """This process ends when `parent`, the process that started it, does, however that one
    ends (a SIGKILL to it alone, as the out-of-memory killer sends, included). Linux only."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    set_parent_death_signal = 1  # PR_SET_PDEATHSIG
    ctypes.CDLL(None, use_errno=True).prctl(set_parent_death_signal, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)


def read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    """`size` bytes, or None where the stream ends first."""
    data = stream.read(size)
    return data if len(data) == size else None


def read_frame(stream: IO[bytes]) -> bytes | None:
    header = read_exactly(stream, LENGTH.size)
    return None if header is None else read_exactly(stream, LENGTH.unpack(header)[0])


def pack_pieces(pieces: Sequence[str]) -> bytes:
    encoded = [piece.encode("utf-8") for piece in pieces]
    lengths = struct.pack(f"<{len(encoded)}Q", *(len(data) for data in encoded))
    body = COUNT.pack(len(encoded)) + lengths + b"".join(encoded)
    return LENGTH.pack(len(body)) + body


def unpack_pieces(frame: bytes) -> list[str]:
    (count,) = COUNT.unpack_from(frame)
    lengths = struct.unpack_from(f"<{count}Q", frame, COUNT.size)
    pieces, offset = [], COUNT.size + 8 * count
    for length in lengths:
        pieces.append(frame[offset : offset + length].decode("utf-8"))
        offset += length
    return pieces


def encode(tokenizer: TextTokenizer, pieces: list[str], dtype: str) -> bytes:
    """The pieces' ids as little-endian `dtype`, each piece followed by the end-of-text token:
    what `tokenizer.encode` gives piece by piece, a BPE's in one batch call."""
    if isinstance(tokenizer, BPETokenizer):
        ids = tokenizer.encode_batch(pieces)
    else:
        ids = [tokenizer.encode(piece) for piece in pieces]
    tokens = array(TYPECODES[dtype])
    for piece in ids:
        tokens.extend(piece)
        tokens.append(tokenizer.end_of_text)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def serve(parent: int) -> None:
    """A worker's life: the tokenizer, then one answer per batch until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print cannot garble an answer
    requests = sys.stdin.buffer
    try:
        header = read_frame(requests)
        if header is None:
            return
        settings = json.loads(header)
        tokenizer = load_tokenizer(Path(settings["tokenizer"]))
        while (frame := read_frame(requests)) is not None:
            data = encode(tokenizer, unpack_pieces(frame), settings["dtype"])
            answers.write(ANSWER.pack(TOKENS, len(data)))
            answers.write(data)
            answers.flush()
    except TokenizerFailed as error:
        text = str(error).encode(errors="replace")
        answers.write(ANSWER.pack(REFUSED, len(text)) + text)
        answers.flush()
        sys.exit(1)
    except Exception as error:
        traceback.print_exc()  # the whole story, on the command's stderr; the answer says what
        text = traceback.format_exception_only(error)[-1].strip().encode(errors="replace")
        answers.write(ANSWER.pack(ERROR, len(text)) + text)
        answers.flush()
        sys.exit(1)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
