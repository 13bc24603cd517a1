"""Readers for the published on-disk formats: IDX (MNIST family), CIFAR python batches,
LIBSVM/SVMlight text and ``.npz``. Each returns numpy arrays exactly as stored; the loaders
in ``batchbound.data.files`` decide shapes and normalisation.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np

from batchbound.errors import BatchboundError

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (raw, or gzipped when the name ends in ``.gz``) as an array.

    The magic number is two zero bytes, a type code and the number of dimensions; then one
    big-endian uint32 per dimension, then the data in C order.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise BatchboundError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(v) for v in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise BatchboundError(
            f"{path}: IDX header says shape {shape} ({expected} bytes) but the file has "
            f"{len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


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


def read_cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch: a pickled dict with ``b"data"`` (n, 3072) uint8 in
    channel-major order and labels under ``label_key``. Returns (n, 3, 32, 32) uint8 and int64.
    """
    with open(path, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    if b"data" not in batch or label_key not in batch:
        raise BatchboundError(
            f"{path}: not a CIFAR python batch (keys {sorted(batch)}; expected b'data' and "
            f"{label_key!r})"
        )
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(batch[label_key], dtype=np.int64)


def read_svmlight(path: Path, n_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LIBSVM/SVMlight text (``label index:value ...``; ``.gz``/``.bz2`` decompressed) as a
    dense float32 matrix and float64 labels."""
    from sklearn.datasets import load_svmlight_file

    try:
        x, y = load_svmlight_file(str(path), n_features=n_features)
    except ValueError as exc:
        raise BatchboundError(f"{path}: not a LIBSVM/SVMlight file: {exc}") from None
    return np.asarray(x.todense(), dtype=np.float32), np.asarray(y, dtype=np.float64)
