"""Data sets read from files a user already has, in their published formats.

Where the files are looked for, in order: ``DIR/<name>/`` then ``DIR/`` itself, where DIR is
``--data-dir``, else ``$BATCHBOUND_DATA``, else ``~/.cache/batchbound/data``. Fashion-MNIST
also falls back to ``/usr/share/datasets/fashion-mnist/`` (Debian's dataset-fashion-mnist).

Normalisation: images are scaled to [0, 1] and standardised with the training split's own
statistics (one mean/std for grey images, one per channel for CIFAR), which reproduces the
usual constants (MNIST 0.1307/0.3081, CIFAR-10 (0.4914, 0.4822, 0.4465)/(0.2470, 0.2435,
0.2616)). LIBSVM and npz inputs are used as stored. The statistics go in ``Dataset.meta``.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from numpy.lib.npyio import NpzFile

from batchbound.data.dataset import CLASSIFICATION, REGRESSION, Dataset
from batchbound.data.formats import (
    check_values,
    one_line,
    read_cifar_batch,
    read_idx,
    read_svmlight,
)
from batchbound.data.identity import note_read
from batchbound.data.registry import MissingCheck, register_dataset
from batchbound.data.splits import split_indices
from batchbound.errors import BatchboundError

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def candidate_dirs(data_dir: Path, name: str, extra: Sequence[Path] = ()) -> list[Path]:
    return [data_dir / name, data_dir, *extra]


def _locate(directory: Path, name: str, compressed: Sequence[str]) -> Path | None:
    options = [directory / name] + [directory / f"{name}{s}" for s in compressed]
    return next((p for p in options if p.is_file()), None)


def find_files(
    dirs: Sequence[Path], names: Sequence[str], compressed: Sequence[str]
) -> list[Path] | None:
    """The first directory holding every name (each raw or with one of the ``compressed``
    suffixes); ``None`` when no directory has them all."""
    for directory in dirs:
        found = [p for p in (_locate(directory, n, compressed) for n in names) if p is not None]
        if len(found) == len(names):
            for path in found:
                note_read(path)  # part of the data's identity (batchbound.data.identity)
            return found
    return None


def missing_message(
    dirs: Sequence[Path], names: Sequence[str], compressed: Sequence[str], note: str
) -> str:
    """What ``data list`` shows: which files, where they were looked for, and which ones a
    directory holding only some of them lacks."""
    message = f"needs {', '.join(names)}{note}; not found in {', '.join(str(d) for d in dirs)}"
    for directory in dirs:
        if directory.is_dir():
            lacking = [n for n in names if _locate(directory, n, compressed) is None]
            if len(lacking) < len(names):
                message += f"; {directory} lacks {', '.join(lacking)}"
    return message


def missing_error(label: str, reason: str) -> BatchboundError:
    return BatchboundError(
        f"data set {label!r} {reason}. Put the files in DIR/{label}/ or DIR itself and pass "
        "--data-dir DIR (or set $BATCHBOUND_DATA=DIR)."
    )


def standardise(
    train: np.ndarray, test: np.ndarray, axes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, list[float], list[float]]:
    """(x − mean)/std for both splits with statistics of ``train`` over ``axes`` (images already
    in [0, 1]), computed once: on 47 M pixels each pass costs about a second."""
    mean = train.mean(axis=axes, keepdims=True, dtype=np.float64)
    std = train.std(axis=axes, keepdims=True, dtype=np.float64)
    # statistics in float64, arithmetic in float32: EMNIST byclass is 547 M pixels
    mean32, std32 = mean.astype(np.float32), std.astype(np.float32)
    out_train, out_test = (torch.from_numpy((x - mean32) / std32) for x in (train, test))
    return out_train, out_test, mean.ravel().tolist(), std.ravel().tolist()


# --------------------------------------------------------------------------- IDX family

IDX_FILES = (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)  # fmt: skip

EMNIST_SPLITS = {  # split: (classes, n_train, n_test)
    "balanced": (47, 112_800, 18_800),
    "byclass": (62, 697_932, 116_323),
    "bymerge": (47, 697_932, 116_323),
    "digits": (10, 240_000, 40_000),
    "letters": (26, 124_800, 20_800),
    "mnist": (10, 60_000, 10_000),
}


def emnist_files(split: str) -> tuple[str, ...]:
    return tuple(
        f"emnist-{split}-{part}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
        for part in ("train", "test") for kind in ("images", "labels")
    )  # fmt: skip


def _idx_dataset(
    name: str, dirs: list[Path], files: Sequence[str], classes: int, source: str,
    note: str = "", transpose: bool = False, label_offset: int = 0,
) -> Dataset:  # fmt: skip
    found = find_files(dirs, files, (".gz",))
    if found is None:
        raise missing_error(name, missing_message(dirs, files, (".gz",), note))
    x_tr, y_tr, x_te, y_te = (read_idx(p) for p in found)
    for images, labels, path in ((x_tr, y_tr, found[0]), (x_te, y_te, found[2])):
        if images.ndim != 3 or len(images) != len(labels):
            raise BatchboundError(
                f"{path}: expected (n, H, W) images matching {len(labels)} labels, "
                f"got shape {images.shape}"
            )
    for labels, path in ((y_tr, found[1]), (y_te, found[3])):
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise BatchboundError(
                f"{path}: expected a 1-d array of integer labels, got {labels.dtype} of shape "
                f"{labels.shape}"
            )
        if labels.size == 0:
            raise BatchboundError(f"{path}: no labels")
        low, high = int(labels.min()) - label_offset, int(labels.max()) - label_offset
        if low < 0 or high >= classes:
            raise BatchboundError(
                f"{path}: labels run from {low + label_offset} to {high + label_offset}; "
                f"{name} has {classes} classes. Is this the right data set's file?"
            )
    if transpose:  # EMNIST stores each image transposed relative to MNIST
        x_tr, x_te = x_tr.transpose(0, 2, 1), x_te.transpose(0, 2, 1)
    train = x_tr[:, None].astype(np.float32) / 255.0
    test = x_te[:, None].astype(np.float32) / 255.0
    x_train, x_test, mean, std = standardise(train, test, (0, 1, 2, 3))
    return Dataset(
        name=name,
        task=CLASSIFICATION,
        x_train=x_train,
        y_train=torch.from_numpy(y_tr.astype(np.int64) - label_offset),
        x_test=x_test,
        y_test=torch.from_numpy(y_te.astype(np.int64) - label_offset),
        num_classes=classes,
        source=f"{source} in {found[0].parent}",
        meta={"files": [str(p) for p in found], "mean": mean, "std": std},
    )


def _register_idx(
    name: str, source: str, classes: int, n_train: int, n_test: int, files: Sequence[str],
    extra: Sequence[Path] = (), note: str = "", transpose: bool = False, label_offset: int = 0,
) -> None:  # fmt: skip
    def check(data_dir: Path) -> str | None:
        dirs = candidate_dirs(data_dir, name, extra)
        if find_files(dirs, files, (".gz",)) is None:
            return missing_message(dirs, files, (".gz",), note)
        return None

    def load(data_dir: Path) -> Dataset:
        dirs = candidate_dirs(data_dir, name, extra)
        return _idx_dataset(name, dirs, files, classes, source, note, transpose, label_offset)

    register_dataset(
        name, source=source, embedded=False, task=CLASSIFICATION, n_train=n_train,
        n_test=n_test, input_shape=(1, 28, 28), classes=classes, check=check,
        description=f"28x28 grey images, {classes} classes; IDX files " + ", ".join(files),
    )(load)  # fmt: skip


_GZ_NOTE = " (each raw or .gz)"
_register_idx(
    "fashion-mnist", "Fashion-MNIST (Xiao et al. 2017), IDX files", 10, 60_000, 10_000,
    IDX_FILES, extra=(DEBIAN_FASHION_MNIST,),
    note=_GZ_NOTE + "; on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist",
)  # fmt: skip
_register_idx(
    "mnist", "MNIST (LeCun et al.), IDX files", 10, 60_000, 10_000, IDX_FILES, note=_GZ_NOTE
)
_register_idx(
    "kmnist",
    "Kuzushiji-MNIST (Clanuwat et al. 2018), IDX files",
    10,
    60_000,
    10_000,
    IDX_FILES,
    note=_GZ_NOTE,
)
for _split, (_classes, _n_train, _n_test) in EMNIST_SPLITS.items():
    _register_idx(
        f"emnist-{_split}", f"EMNIST {_split} (Cohen et al. 2017), IDX files from gzip.zip",
        _classes, _n_train, _n_test, emnist_files(_split), note=_GZ_NOTE, transpose=True,
        label_offset=1 if _split == "letters" else 0,  # letters are labelled 1..26
    )  # fmt: skip


# --------------------------------------------------------------------------- CIFAR

CIFAR = {  # name: (folder, train files, test files, label key, classes)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)],
                ["test_batch"], b"labels", 10),
    "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100),
}  # fmt: skip


def _cifar_dirs(data_dir: Path, name: str) -> list[Path]:
    folder = CIFAR[name][0]
    return [data_dir / folder, data_dir / name / folder, data_dir / name, data_dir]


def _cifar_check(name: str) -> MissingCheck:
    def check(data_dir: Path) -> str | None:
        folder, train, test, _, _ = CIFAR[name]
        dirs = _cifar_dirs(data_dir, name)
        if find_files(dirs, train + test, ()) is None:
            return missing_message(
                dirs, train + test, (), f" (the {folder} folder of the python version)"
            )
        return None

    return check


def _load_cifar(data_dir: Path, name: str, label_key: bytes) -> Dataset:
    _, train_names, test_names, _, classes = CIFAR[name]
    classes = 20 if label_key == b"coarse_labels" else classes
    dirs = _cifar_dirs(data_dir, name)
    found = find_files(dirs, train_names + test_names, ())
    if found is None:
        raise missing_error(name, _cifar_check(name)(data_dir) or "")
    parts = [read_cifar_batch(p, label_key, classes) for p in found]
    n_tr = len(train_names)
    x_tr = np.concatenate([p[0] for p in parts[:n_tr]]).astype(np.float32) / 255.0
    x_te = np.concatenate([p[0] for p in parts[n_tr:]]).astype(np.float32) / 255.0
    x_train, x_test, mean, std = standardise(x_tr, x_te, (0, 2, 3))
    labels = [
        torch.from_numpy(np.concatenate([p[1] for p in group]))
        for group in (parts[:n_tr], parts[n_tr:])
    ]
    return Dataset(
        name=name,
        task=CLASSIFICATION,
        x_train=x_train,
        y_train=labels[0],
        x_test=x_test,
        y_test=labels[1],
        num_classes=classes,
        source=f"{name} python batches in {found[0].parent}",
        meta={
            "files": [str(p) for p in found],
            "mean": mean,
            "std": std,
            "labels": label_key.decode(),
        },
    )


@register_dataset(
    "cifar10", source="CIFAR-10 (Krizhevsky 2009), python batches", embedded=False,
    description="32x32 colour images, 10 classes; cifar-10-batches-py/data_batch_1..5, test_batch",
    task=CLASSIFICATION, n_train=50_000, n_test=10_000, input_shape=(3, 32, 32), classes=10,
    check=_cifar_check("cifar10"),
)  # fmt: skip
def load_cifar10(data_dir: Path) -> Dataset:
    return _load_cifar(data_dir, "cifar10", b"labels")


@register_dataset(
    "cifar100", source="CIFAR-100 (Krizhevsky 2009), python batches", embedded=False,
    description="32x32 colour images, 100 fine classes (labels=coarse for 20); "
    "cifar-100-python/train, test",
    task=CLASSIFICATION, n_train=50_000, n_test=10_000, input_shape=(3, 32, 32), classes=100,
    check=_cifar_check("cifar100"),
)  # fmt: skip
def load_cifar100(data_dir: Path, labels: str = "fine") -> Dataset:
    if labels not in ("fine", "coarse"):
        raise BatchboundError(f"cifar100: labels must be fine or coarse, got {labels!r}")
    return _load_cifar(data_dir, "cifar100", f"{labels}_labels".encode())


# --------------------------------------------------------------------------- LIBSVM, npz


def resolve_user_file(data_dir: Path, path: object, label: str, option: str) -> Path:
    """``path`` as given (absolute or relative to the working directory), else under DIR."""
    if not isinstance(path, str) or not path:
        raise BatchboundError(f"{label}: needs {option}=FILE, e.g. {label}({option}=train.txt)")
    given = Path(path).expanduser()
    candidates = list(dict.fromkeys((given, data_dir / given)))  # one, when path is absolute
    for candidate in candidates:
        if candidate.is_file():
            note_read(candidate)  # part of the data's identity (batchbound.data.identity)
            return candidate
    folders = [c for c in candidates if c.is_dir()]
    if folders:  # "not found" would send the user looking for a file that is there
        raise BatchboundError(f"{label}: {option}={path!r} is a directory ({folders[0]}); "
                              f"give a file, e.g. {label}({option}=train.txt)")
    raise BatchboundError(f"{label}: file {path!r} not found (looked at "
                          f"{' and '.join(str(c) for c in candidates)})")


MIN_EXAMPLES = 2  # a batch size to choose needs at least two training examples


def _labels(
    y_train: np.ndarray, y_test: np.ndarray, task: str, label: str
) -> tuple[str, torch.Tensor, torch.Tensor, int | None, list | None]:
    """Classification when every label is integral (mapped to 0..K-1 in sorted order),
    else regression with targets of shape (n, outputs)."""
    # columns from the shape, not -1: an empty test split (test_fraction=0, two examples)
    # has no rows to infer them from
    flat = [y.reshape(len(y), math.prod(y.shape[1:])) for y in (y_train, y_test)]
    if flat[0].shape[1] != flat[1].shape[1]:
        raise BatchboundError(
            f"{label}: training targets have {flat[0].shape[1]} columns, test targets "
            f"{flat[1].shape[1]}"
        )
    both = np.concatenate(flat)
    integral = both.shape[1] == 1 and np.all(np.equal(np.mod(both, 1), 0))
    if task == "auto":
        task = CLASSIFICATION if integral else REGRESSION
    if task == CLASSIFICATION:
        if not integral:
            raise BatchboundError(f"{label}: task=classification needs integer labels")
        values = np.unique(both)
        tr, te = (
            torch.from_numpy(np.searchsorted(values, y.reshape(-1)).astype(np.int64))
            for y in (y_train, y_test)
        )
        return task, tr, te, len(values), values.tolist()
    if task == REGRESSION:
        tr, te = (torch.from_numpy(y.astype(np.float32)) for y in flat)
        return task, tr, te, None, None
    raise BatchboundError(f"{label}: task must be auto, classification or regression, got {task!r}")


def _from_arrays(
    name: str, x: np.ndarray, y: np.ndarray, x_test: np.ndarray | None, y_test: np.ndarray | None,
    task: str, test_fraction: float, split_seed: int, source: str, meta: dict,
) -> Dataset:  # fmt: skip
    """The data set of numeric arrays read from a user's file(s); ``load_dataset``'s
    ``check_dataset`` then refuses non-finite values and inconsistent shapes."""
    if len(x) < MIN_EXAMPLES:
        raise BatchboundError(
            f"{name}: {source} has {len(x)} training example(s); need at least {MIN_EXAMPLES}"
        )
    if x_test is None or y_test is None:
        train_idx, test_idx = split_indices(len(y), test_fraction, split_seed)
        if len(train_idx) < MIN_EXAMPLES:
            raise BatchboundError(
                f"{name}: test_fraction={test_fraction} leaves {len(train_idx)} of {len(y)} "
                f"examples for training; need at least {MIN_EXAMPLES}"
            )
        x, y, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
        meta = {**meta, "split": f"test_fraction={test_fraction},split_seed={split_seed}"}
    # NaN, inf and values past float32 are refused by check_dataset in one line; numpy's
    # warnings about them would only add lines to the error
    with np.errstate(over="ignore", invalid="ignore"):
        task, y_tr, y_te, classes, values = _labels(y, y_test, task, name)
        x_train, x_te = (torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in (x, x_test))
    if values is not None:
        meta = {**meta, "label_values": values}
    return Dataset(
        name=name, task=task,
        x_train=x_train, y_train=y_tr, x_test=x_te, y_test=y_te,
        num_classes=classes, source=source, meta=meta,
    )  # fmt: skip


@register_dataset(
    "libsvm", source="your LIBSVM/SVMlight text file(s)", embedded=False,
    description="libsvm(path=FILE[,test=FILE][,task=auto|classification|regression]); "
    "no test file: deterministic 80/20 split; features used as stored",
)  # fmt: skip
def load_libsvm(
    data_dir: Path, path: str | None = None, test: str | None = None, task: str = "auto",
    test_fraction: float = 0.2, split_seed: int = 0,
) -> Dataset:  # fmt: skip
    train_path = resolve_user_file(data_dir, path, "libsvm", "path")
    x, y = read_svmlight(train_path)
    x_te = y_te = None
    if test is not None:
        test_path = resolve_user_file(data_dir, test, "libsvm", "test")
        x_te, y_te = read_svmlight(test_path, n_features=x.shape[1])
    return _from_arrays(
        "libsvm",
        x,
        y,
        x_te,
        y_te,
        task,
        test_fraction,
        split_seed,
        f"LIBSVM file {train_path}",
        {"path": str(train_path)},
    )


GISETTE_FILES = ("gisette_scale", "gisette_scale.t")


def _gisette_check(data_dir: Path) -> str | None:
    dirs = candidate_dirs(data_dir, "gisette")
    if find_files(dirs, GISETTE_FILES, (".bz2", ".gz")) is None:
        return missing_message(
            dirs,
            GISETTE_FILES,
            (".bz2", ".gz"),
            " (LIBSVM text from the LIBSVM data page; raw, .bz2 or .gz)",
        )
    return None


@register_dataset(
    "gisette", source="Gisette (NIPS 2003 feature selection), LIBSVM scaled version",
    embedded=False, description="5000 features scaled to [-1, 1], labels ±1 mapped to 0/1; "
    "files gisette_scale, gisette_scale.t",
    task=CLASSIFICATION, n_train=6000, n_test=1000, input_shape=(5000,), classes=2,
    check=_gisette_check,
)  # fmt: skip
def load_gisette(data_dir: Path) -> Dataset:
    dirs = candidate_dirs(data_dir, "gisette")
    found = find_files(dirs, GISETTE_FILES, (".bz2", ".gz"))
    if found is None:
        raise missing_error("gisette", _gisette_check(data_dir) or "")
    x, y = read_svmlight(found[0], n_features=5000)
    x_te, y_te = read_svmlight(found[1], n_features=5000)
    return _from_arrays(
        "gisette",
        x,
        y,
        x_te,
        y_te,
        CLASSIFICATION,
        0.0,
        0,
        f"Gisette LIBSVM files in {found[0].parent}",
        {"files": [str(p) for p in found]},
    )


NPZ_KEYS = ("x", "y", "x_test", "y_test")
# what a broken zip archive or .npy member raises while numpy reads it
_NPZ_ERRORS = (ValueError, EOFError, OSError, MemoryError, zipfile.BadZipFile, zlib.error)


def read_npz(file: Path) -> dict[str, np.ndarray]:
    """x, y and (both or neither) x_test, y_test of an .npz archive, each checked to be a
    numeric array with one row per example. Nothing is unpickled (``allow_pickle=False``)."""
    try:
        with open(file, "rb") as handle:  # ours to close: np.load leaks its own on a bad zip
            arrays = _npz_arrays(handle, file)
    except OSError as exc:  # opening it; a broken archive is caught where it is read
        raise BatchboundError(f"npz: cannot read {file}: {one_line(exc)}") from None
    for xs, ys in (("x", "y"), ("x_test", "y_test")):
        if xs in arrays and len(arrays[xs]) != len(arrays[ys]):
            raise BatchboundError(
                f"npz: {xs} has {len(arrays[xs])} rows but {ys} has {len(arrays[ys])}"
            )
    return arrays


def _npz_arrays(handle: BinaryIO, file: Path) -> dict[str, np.ndarray]:
    head = handle.read(6)
    handle.seek(0)
    # np.load takes any other bytes for a pickle and names that: not what the file is
    if not head.startswith((b"PK", b"\x93NUMPY")):
        raise BatchboundError(
            f"npz: {file} is not a readable .npz archive: not a zip file; write one with "
            "np.savez(FILE, x=..., y=...)"
        )
    try:
        archive = np.load(handle, allow_pickle=False)
    except _NPZ_ERRORS as exc:
        raise BatchboundError(
            f"npz: {file} is not a readable .npz archive: {one_line(exc)}"
        ) from None
    if not isinstance(archive, NpzFile):
        raise BatchboundError(
            f"npz: {file} holds a single array (.npy), not an .npz archive; write one with "
            "np.savez(FILE, x=..., y=...)"
        )
    with archive:
        for key in ("x", "y"):
            if key not in archive.files:
                raise BatchboundError(
                    f"npz: {file} has no array {key!r} (has {sorted(archive.files)}); "
                    "expected x, y and optionally x_test, y_test"
                )
        if ("x_test" in archive.files) != ("y_test" in archive.files):
            raise BatchboundError(f"npz: {file} must have both x_test and y_test, or neither")
        return {key: _npz_array(archive, key, file) for key in NPZ_KEYS if key in archive.files}


def _npz_header_values(archive: NpzFile, key: str) -> int | None:
    """The number of values a member's .npy header declares, read without its data (None
    when the header cannot be read: reading the member then names the problem)."""
    try:
        with archive.zip.open(f"{key}.npy") as member:
            version = np.lib.format.read_magic(member)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, _ = read(member)
    except (*_NPZ_ERRORS, KeyError):
        return None
    return math.prod(shape)


def _npz_array(archive: NpzFile, key: str, file: Path) -> np.ndarray:
    declared = _npz_header_values(archive, key)
    if declared is not None:  # bounded before reading, as every format is
        check_values(f"npz: {key} in {file}", declared, "its shape")
    try:
        array = archive[key]
    except _NPZ_ERRORS as exc:  # object arrays too: they would need unpickling
        raise BatchboundError(
            f"npz: {file}: array {key!r} cannot be read: {one_line(exc)}"
        ) from None
    if not isinstance(array, np.ndarray):  # a zip member that is not a .npy file
        raise BatchboundError(f"npz: {file}: {key!r} is not a .npy array")
    if array.dtype.kind not in "biuf":
        hint = "; map class names to integers first" if array.dtype.kind in "SU" else ""
        raise BatchboundError(
            f"npz: {key} in {file} has dtype {array.dtype}; needs real numbers (bool, integer "
            f"or float){hint}"
        )
    if array.ndim == 0:
        raise BatchboundError(
            f"npz: {key} in {file} is a single value (0-d); needs one row per example"
        )
    if key.startswith("x") and (array.ndim < 2 or math.prod(array.shape[1:]) == 0):
        raise BatchboundError(
            f"npz: {key} in {file} has shape {array.shape}; needs (n, features...), one row of "
            "at least one feature per example (a single feature: x.reshape(-1, 1))"
        )
    return array


@register_dataset(
    "npz", source="your .npz file", embedded=False,
    description="npz(path=FILE[,task=...]) with arrays x, y and optionally x_test, y_test "
    "(else a deterministic 80/20 split); x used as stored",
)  # fmt: skip
def load_npz(
    data_dir: Path, path: str | None = None, task: str = "auto", test_fraction: float = 0.2,
    split_seed: int = 0,
) -> Dataset:  # fmt: skip
    file = resolve_user_file(data_dir, path, "npz", "path")
    arrays = read_npz(file)
    return _from_arrays(
        "npz",
        arrays["x"],
        arrays["y"],
        arrays.get("x_test"),
        arrays.get("y_test"),
        task,
        test_fraction,
        split_seed,
        f"npz file {file}",
        {"path": str(file)},
    )
