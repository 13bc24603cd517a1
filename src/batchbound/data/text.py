"""Text for character-level language models: ``fortunes`` (Debian's fortune cookies, real
English prose and verse) and ``text(path=FILE)`` (your own UTF-8 file).

Tokens. One fixed vocabulary for every text, so a model trained on one text reads another:
0 is the unknown symbol (any character outside the vocabulary), 1 tab, 2 newline, 3..97 the
printable ASCII characters ' '..'~'; 98 symbols. Overstrike pairs ``X<backspace>Y`` (old
bold and underline in the fortune files) are reduced to ``Y`` first.

Split. Whole documents are held out, never windows of a shared text: documents are fortunes
(separated by ``%`` lines) or, in your file, paragraphs (separated by blank lines); every
``test_every``-th document (the 10th, 20th, ... with the default 10) is test text, the rest
train text. Each split's documents are joined again with their separator.

Sequences. Each split's text is cut into non-overlapping windows of ``context`` tokens. An
input is a window, its target the same window shifted one character on, so inputs are
(n, context) int64 token ids and targets (n, context) int64 next tokens; every character
but the first is a target once. The task is ``text``: the model's output width is the
vocabulary size, the default loss the sum of the context's token cross-entropies
(``sequence_cross_entropy``), accuracy the fraction of next tokens predicted right.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchbound.data.dataset import TEXT, Dataset
from batchbound.data.files import (
    candidate_dirs,
    find_files,
    missing_error,
    missing_message,
    resolve_user_file,
)
from batchbound.data.formats import MAX_TEXT_BYTES, check_size
from batchbound.data.registry import register_dataset
from batchbound.errors import BatchboundError

UNKNOWN = "\ufffd"  # how the unknown symbol is shown when decoding
VOCABULARY = UNKNOWN + "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCABULARY)  # 98

DEBIAN_FORTUNES = Path("/usr/share/games/fortunes")
# English files of Debian's fortunes/fortunes-min (not the offensive off/ folder); ascii-art
# is pictures and translate-me mostly Latin, so "all" leaves them out.
FORTUNE_FILES = (
    "art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education",
    "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
    "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous",
    "news", "paradoxum", "people", "perl", "pets", "platitudes", "politics", "pratchett",
    "riddles", "science", "songs-poems", "sports", "startrek", "tao", "wisdom", "work", "zippy",
)  # fmt: skip
# the three files of fortunes-min, which the fortunes package depends on: 98 kB of text
DEFAULT_FILES = ("fortunes", "literature", "riddles")
DEFAULT_CONTEXT = 64
# the default set's sizes (checked by the tests against the files)
DEFAULT_N_TRAIN, DEFAULT_N_TEST = 1389, 147

_TABLE = np.zeros(128, dtype=np.int64)  # code point -> token id; 0 (unknown) by default
for _i, _c in enumerate(VOCABULARY[1:], start=1):
    _TABLE[ord(_c)] = _i
_OVERSTRIKE = re.compile(r"[^\x08]\x08")
_FORTUNE_SEPARATOR = re.compile(r"^%\n", re.MULTILINE)
_PARAGRAPH_SEPARATOR = re.compile(r"\n[ \t]*\n+")


def encode(text: str) -> np.ndarray:
    """Token ids of ``text`` (int64); characters outside the vocabulary become 0."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    ids = np.zeros(len(points), dtype=np.int64)
    ascii_ = points < 128
    ids[ascii_] = _TABLE[points[ascii_]]
    return ids


def decode(ids: Sequence[int] | torch.Tensor | np.ndarray) -> str:
    """The text of token ids (the unknown symbol shows as U+FFFD)."""
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return "".join(VOCABULARY[int(i)] for i in values)


def split_documents(documents: Sequence[str], test_every: int) -> tuple[list[str], list[str]]:
    """Every ``test_every``-th document (1-based: the 10th, 20th, ...) to test; 0: none."""
    if test_every == 0:
        return list(documents), []
    train = [d for i, d in enumerate(documents) if (i + 1) % test_every]
    test = [d for i, d in enumerate(documents) if not (i + 1) % test_every]
    return train, test


def windows(ids: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (inputs, next-token targets) windows of ``context`` tokens."""
    n = max(0, (len(ids) - 1) // context)
    x = ids[: n * context].reshape(n, context)
    y = ids[1 : n * context + 1].reshape(n, context)
    return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def _check_options(label: str, context: Any, test_every: Any) -> None:
    for key, value, low in (("context", context, 1), ("test_every", test_every, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BatchboundError(f"{label}: {key} must be an integer >= {low}, got {value!r}")
    if test_every == 1:
        raise BatchboundError(
            f"{label}: test_every=1 would hold out every document; use 0 (no test split) or >= 2"
        )


def text_dataset(
    name: str, documents: Sequence[str], separator: str, context: int, test_every: int,
    source: str, meta: dict[str, Any],
) -> Dataset:  # fmt: skip
    """The ``text`` task data set of ``documents``, split and windowed as the module says."""
    _check_options(name, context, test_every)
    train_docs, test_docs = split_documents(documents, test_every)
    train_text, test_text = separator.join(train_docs), separator.join(test_docs)
    train_ids, test_ids = encode(train_text), encode(test_text)
    if len(train_ids) < context + 1:
        raise BatchboundError(
            f"{name}: the training text has {len(train_ids)} characters, fewer than "
            f"context + 1 = {context + 1}; use a smaller context or more text"
        )
    x_train, y_train = windows(train_ids, context)
    x_test, y_test = windows(test_ids, context)
    unknown = int((train_ids == 0).sum() + (test_ids == 0).sum())
    return Dataset(
        name=name,
        task=TEXT,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=VOCAB_SIZE,
        source=source,
        meta={
            **meta,
            "context": context,
            "test_every": test_every,
            "documents": [len(train_docs), len(test_docs)],
            "characters": [len(train_ids), len(test_ids)],
            "unknown_characters": unknown,
            "vocabulary": VOCABULARY,
        },
    )


def clean(text: str) -> str:
    """Overstrikes reduced to the character printed last; Windows line ends to ``\\n``."""
    text = text.replace("\r\n", "\n")
    previous = None
    while previous != text:  # "a\b_\bb" needs two passes
        previous, text = text, _OVERSTRIKE.sub("", text)
    return text


# --------------------------------------------------------------------------- fortunes

_FORTUNES_NOTE = (
    " (Debian's fortune files); on Debian/Ubuntu: sudo apt-get install fortunes"
)


def _fortune_names(files: Any) -> tuple[str, ...]:
    if files == "all":
        return FORTUNE_FILES
    names = [files] if isinstance(files, str) else files
    if not isinstance(names, (list, tuple)) or not names:
        raise BatchboundError(
            f"fortunes: files must be all, a file name or a list such as [wisdom,tao], got "
            f"{files!r}"
        )
    unknown = [n for n in names if n not in FORTUNE_FILES]
    if unknown:
        raise BatchboundError(
            f"fortunes: unknown file(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(FORTUNE_FILES)} or all"
        )
    if len(set(names)) != len(names):
        raise BatchboundError(f"fortunes: a file is listed twice in {list(names)}")
    return tuple(names)


def _fortunes_check(data_dir: Path) -> str | None:
    dirs = candidate_dirs(data_dir, "fortunes", (DEBIAN_FORTUNES,))
    if find_files(dirs, DEFAULT_FILES, ()) is None:
        return missing_message(dirs, DEFAULT_FILES, (), _FORTUNES_NOTE)
    return None


def read_fortunes(path: Path) -> list[str]:
    """The fortunes of one strfile text file, each ending in a newline, empty ones dropped."""
    check_size(path, MAX_TEXT_BYTES, "a fortune file")
    text = clean(path.read_text(encoding="utf-8", errors="replace"))
    pieces = _FORTUNE_SEPARATOR.split(text if text.endswith("\n") else text + "\n")
    return [p for p in pieces if p.strip()]


@register_dataset(
    "fortunes",
    source="Debian's fortunes package (fortune cookie files), /usr/share/games/fortunes",
    embedded=False,
    description=f"char-level next-token prediction, {VOCAB_SIZE} symbols; default files "
    f"{', '.join(DEFAULT_FILES)} (98 kB, fortunes-min), context {DEFAULT_CONTEXT}: "
    f"{DEFAULT_N_TRAIN}/{DEFAULT_N_TEST} sequences, every 10th fortune held out; options "
    "files=[..]|all, context, test_every",
    task=TEXT, n_train=DEFAULT_N_TRAIN, n_test=DEFAULT_N_TEST, input_shape=(DEFAULT_CONTEXT,),
    classes=VOCAB_SIZE, check=_fortunes_check,
)  # fmt: skip
def load_fortunes(
    data_dir: Path, files: Any = None, context: int = DEFAULT_CONTEXT, test_every: int = 10
) -> Dataset:
    """Fortunes of the named files, in the order given; every ``test_every``-th is test."""
    names = DEFAULT_FILES if files is None else _fortune_names(files)
    _check_options("fortunes", context, test_every)
    dirs = candidate_dirs(data_dir, "fortunes", (DEBIAN_FORTUNES,))
    found = find_files(dirs, names, ())
    if found is None:
        raise missing_error("fortunes", missing_message(dirs, names, (), _FORTUNES_NOTE))
    documents = [doc for path in found for doc in read_fortunes(path)]
    return text_dataset(
        "fortunes", documents, "%\n", context, test_every,
        f"fortune files {', '.join(names)} in {found[0].parent}",
        {"files": [str(p) for p in found]},
    )  # fmt: skip


# --------------------------------------------------------------------------- your file


@register_dataset(
    "text",
    source="your UTF-8 text file",
    embedded=False,
    description=f"text(path=FILE[,context=64][,test_every=10]): char-level next-token "
    f"prediction, {VOCAB_SIZE} symbols; every 10th paragraph (blank-line separated) held out",
    task=TEXT, classes=VOCAB_SIZE,
)  # fmt: skip
def load_text(
    data_dir: Path, path: str | None = None, context: int = DEFAULT_CONTEXT, test_every: int = 10
) -> Dataset:
    """Your file's paragraphs; every ``test_every``-th is test (0: no test split)."""
    file = resolve_user_file(data_dir, path, "text", "path")
    _check_options("text", context, test_every)
    check_size(file, MAX_TEXT_BYTES, "text")  # before reading: an 8 GB file was a MemoryError
    try:
        raw = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BatchboundError(f"text: {file} is not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start})") from None
    except OSError as exc:
        raise BatchboundError(f"text: cannot read {file}: {exc.strerror or exc}") from None
    paragraphs = [p.strip("\n") + "\n" for p in _PARAGRAPH_SEPARATOR.split(clean(raw))]
    documents = [p for p in paragraphs if p.strip()]
    return text_dataset(
        "text", documents, "\n", context, test_every, f"text file {file}", {"path": str(file)}
    )
