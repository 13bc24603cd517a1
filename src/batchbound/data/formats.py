"""Readers for the published on-disk formats: IDX (MNIST family), CIFAR python batches,
LIBSVM/SVMlight text and ``.npz``. Each returns numpy arrays exactly as stored; the loaders
in ``batchbound.data.files`` decide shapes and normalisation.

Nothing in a file is executed: CIFAR batches are pickles, so they go through an unpickler
that can build numpy arrays and nothing else (``CifarUnpickler``). Every way a file can be
broken (truncated, not gzip, garbage) ends in a ``BatchboundError`` naming the file.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from batchbound.errors import BatchboundError

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# What a broken compressed or raw file raises while being read.
_READ_ERRORS = (OSError, EOFError, zlib.error)
_CHUNK = 1 << 24  # read payloads in 16 MiB pieces: memory follows the bytes actually there
# LIBSVM is held dense: refuse a matrix of more float32 values than this (4 GiB).
MAX_DENSE_VALUES = 1 << 30


# Every format is bounded before it is read, as TOML files are (config.read_small_file):
# a file past its bound is refused in one line instead of a MemoryError part way through.
MAX_TEXT_BYTES = 256 << 20  # a character becomes three int64s (its id, input, target)
MAX_PICKLE_BYTES = 1 << 30  # a CIFAR batch is read whole (CIFAR-100's train: 150 MB)
MAX_SVMLIGHT_BYTES = 4 << 30  # LIBSVM text, parsed whole by sklearn


def check_size(path: Path, limit: int, what: str) -> None:
    """Refuse ``path`` when it is larger than ``limit`` bytes, before reading it."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise BatchboundError(f"{path}: cannot be read: {one_line(exc)}") from None
    if size > limit:
        raise BatchboundError(
            f"{path}: {size:,} bytes, more than the {limit:,} batchbound reads as {what}; "
            "use a smaller file (or a sample of it)"
        )


def check_values(label: str, count: int, what: str) -> None:
    """Refuse a data set of more than ``MAX_DENSE_VALUES`` values before it is made."""
    if count > MAX_DENSE_VALUES:
        raise BatchboundError(
            f"{label}: {what} would be {count:.3g} values, more than the "
            f"{MAX_DENSE_VALUES:.3g} batchbound holds in memory"
        )


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (the CLI prints errors as one line)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_at_most(handle: IO[bytes], size: int) -> bytes:
    """Up to ``size`` bytes, read in chunks so a header claiming more than the file holds
    costs no more memory than the file itself."""
    pieces, left = [], size
    while left > 0:
        piece = handle.read(min(left, _CHUNK))
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (raw, or gzipped when the name ends in ``.gz``) as an array.

    The magic number is two zero bytes, a type code and the number of dimensions; then one
    big-endian uint32 per dimension, then the data in C order.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            magic = _read_at_most(handle, 4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
                raise BatchboundError(
                    f"{path}: not an IDX file (bad magic number {magic.hex() or 'empty'})"
                )
            ndim = magic[3]
            dims = _read_at_most(handle, 4 * ndim)
            if len(dims) < 4 * ndim:
                raise BatchboundError(f"{path}: IDX file ends inside its header ({ndim} dims)")
            shape = tuple(int(v) for v in np.frombuffer(dims, ">u4"))
            dtype = np.dtype(_IDX_DTYPES[magic[2]])
            # a gzipped file can hold far more than its size: bounded by its header first
            check_values(str(path), math.prod(shape), f"its IDX header's shape {shape}")
            size = math.prod(shape) * dtype.itemsize
            payload = _read_at_most(handle, size + 1)  # one more byte: is there extra data?
    except _READ_ERRORS as exc:
        raise BatchboundError(f"{path}: cannot be read as IDX: {one_line(exc)}") from None
    if len(payload) != size:
        found = f"{len(payload) + 4 + 4 * ndim}" if len(payload) < size else "more"
        raise BatchboundError(
            f"{path}: IDX header says shape {shape} ({4 + 4 * ndim + size} bytes) but the file "
            f"has {found} bytes"
        )
    return np.frombuffer(payload, dtype).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` as IDX (gzipped when the name ends in ``.gz``); for tests and exports."""
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _IDX_DTYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise BatchboundError(f"IDX cannot store dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    payload = header + np.ascontiguousarray(array).astype(_IDX_DTYPES[code]).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as handle:
        handle.write(payload)


# --------------------------------------------------------------------------- CIFAR


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle calls something a CIFAR batch does not need."""


def _latin1_encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes for protocol 2: latin-1 only, so no
    codec is looked up by a name taken from the file."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedGlobal(f"_codecs.encode with {encoding!r}")
    return text.encode("latin-1")


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]  # how protocols 2-4 rebuild an array
_FROMBUFFER = np.ndarray.__reduce_ex__(np.zeros(1), 5)[0]  # and protocol 5
# Every global a CIFAR python batch refers to: numpy's array reconstruction (module named
# numpy.core before numpy 2), dtypes, and the latin-1 encode that Python 3 pickles bytes with.
CIFAR_GLOBALS: dict[tuple[str, str], Callable[..., Any] | type] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class CifarUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``CIFAR_GLOBALS``: a pickle can call nothing else, so
    loading a crafted batch builds arrays or fails, and never runs code."""

    def find_class(self, module: str, name: str) -> Any:
        found = CIFAR_GLOBALS.get((module, name))
        if found is None:
            raise RefusedGlobal(f"{module}.{name}")
        return found


def unpickle_cifar(path: Path) -> Any:
    """The object in a CIFAR pickle, read through ``CifarUnpickler``."""
    check_size(path, MAX_PICKLE_BYTES, "a CIFAR python batch")
    try:
        raw = path.read_bytes()  # from memory: a length in the pickle cannot over-allocate
        return CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except RefusedGlobal as exc:
        raise BatchboundError(
            f"{path}: refused: the pickle calls {exc}, which a CIFAR python batch never does "
            "(only numpy arrays are loaded; nothing in the file is executed)"
        ) from None
    except Exception as exc:  # any other failure means the bytes are not a valid pickle
        raise BatchboundError(
            f"{path}: not a CIFAR python batch (unreadable pickle: {one_line(exc)})"
        ) from None


def read_cifar_batch(
    path: Path, label_key: bytes, classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch: a pickled dict with ``b"data"`` (n, 3072) uint8 in
    channel-major order and labels under ``label_key`` (in [0, classes) when given).
    Returns (n, 3, 32, 32) uint8 and int64.
    """
    batch = unpickle_cifar(path)
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = sorted(map(repr, batch)) if isinstance(batch, dict) else type(batch).__name__
        raise BatchboundError(
            f"{path}: not a CIFAR python batch (holds {keys}; expected a dict with b'data' and "
            f"{label_key!r})"
        )
    data = batch[b"data"]
    if not isinstance(data, np.ndarray):
        raise BatchboundError(
            f"{path}: b'data' is a {type(data).__name__}; a CIFAR batch has a uint8 array of "
            "shape (n, 3072)"
        )
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise BatchboundError(
            f"{path}: b'data' is a {data.dtype} array of shape {data.shape}; a CIFAR batch has "
            "a uint8 array of shape (n, 3072)"
        )
    try:
        labels = np.asarray(batch[label_key])
    except (ValueError, TypeError, OverflowError) as exc:
        raise BatchboundError(
            f"{path}: {label_key!r} is not a list of labels: {one_line(exc)}"
        ) from None
    if labels.dtype.kind not in "iu" or labels.shape != (len(data),):
        raise BatchboundError(
            f"{path}: {label_key!r} must be {len(data)} integer labels (one per image), got "
            f"{labels.dtype} values of shape {labels.shape}"
        )
    if classes is not None and len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise BatchboundError(
            f"{path}: labels run from {labels.min()} to {labels.max()}; expected 0 to "
            f"{classes - 1}"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


# --------------------------------------------------------------------------- LIBSVM


def read_svmlight(path: Path, n_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LIBSVM/SVMlight text (``label index:value ...``; ``.gz``/``.bz2`` decompressed) as a
    dense float32 matrix and float64 labels. A file whose dense matrix would hold more than
    ``MAX_DENSE_VALUES`` values (a huge feature index) is refused before it is made dense."""
    from sklearn.datasets import load_svmlight_file

    check_size(path, MAX_SVMLIGHT_BYTES, "LIBSVM text")
    try:
        x, y = load_svmlight_file(str(path), n_features=n_features)
    except OverflowError as exc:  # an index past the parser's int32
        raise BatchboundError(
            f"{path}: a feature index is too large ({one_line(exc)}); LIBSVM data here is "
            f"held dense, at most {MAX_DENSE_VALUES} values"
        ) from None
    except (ValueError, UnicodeError, *_READ_ERRORS) as exc:
        raise BatchboundError(f"{path}: not a LIBSVM/SVMlight file: {one_line(exc)}") from None
    rows, columns = x.shape
    if rows == 0:
        raise BatchboundError(f"{path}: no examples (the file is empty or only comments)")
    if rows * columns > MAX_DENSE_VALUES:
        raise BatchboundError(
            f"{path}: {rows} examples x {columns} features (largest feature index) would be "
            f"{rows * columns:.3g} dense values, more than the {MAX_DENSE_VALUES:.3g} batchbound "
            "holds; is a feature index wrong?"
        )
    return np.asarray(x.todense(), dtype=np.float32), np.asarray(y, dtype=np.float64)
