"""File loaders on small files written here in exactly the published formats."""

from __future__ import annotations

import bz2
import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from batchbound.data import load_dataset
from batchbound.data.formats import read_idx, write_idx
from batchbound.errors import BatchboundError

IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX layout spelled out by hand: 0, 0, type 0x08 (ubyte), ndim, big-endian dims."""
    assert array.dtype == np.uint8
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_idx_set(directory: Path, names, arrays, gz: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in zip(names, arrays, strict=True):
        data = idx_bytes(array)
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)


def fake_images(rng: np.random.Generator, n: int, classes: int = 10, side: int = 28):
    images = rng.integers(0, 256, size=(n, side, side), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n, dtype=np.uint8)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["mnist", "kmnist", "fashion-mnist"])
def test_idx_sets_round_trip(tmp_path: Path, name: str, gz: bool) -> None:
    rng = np.random.default_rng(0)
    (xtr, ytr), (xte, yte) = fake_images(rng, 12), fake_images(rng, 5)
    write_idx_set(tmp_path / name, IDX_NAMES, [xtr, ytr, xte, yte], gz)
    ds = load_dataset(name, tmp_path)
    assert ds.input_shape == (1, 28, 28) and ds.x_train.dtype == torch.float32
    assert torch.equal(ds.y_train, torch.from_numpy(ytr.astype(np.int64)))
    assert torch.equal(ds.y_test, torch.from_numpy(yte.astype(np.int64)))
    # standardised with the training split's own pixel mean/std
    raw = xtr.astype(np.float64) / 255.0
    mean, std = raw.mean(), raw.std()
    assert ds.meta["mean"] == [pytest.approx(mean)] and ds.meta["std"] == [pytest.approx(std)]
    np.testing.assert_allclose(ds.x_train[:, 0].double().numpy(), (raw - mean) / std, atol=1e-5)
    restored = ds.x_test[:, 0].double().numpy() * std + mean
    np.testing.assert_allclose(restored, xte / 255.0, atol=1e-5)


def test_files_directly_in_data_dir(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    (xtr, ytr), (xte, yte) = fake_images(rng, 4), fake_images(rng, 3)
    write_idx_set(tmp_path, IDX_NAMES, [xtr, ytr, xte, yte], gz=True)
    assert load_dataset("mnist", tmp_path).n_train == 4


def test_emnist_transposes_and_shifts_letters(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    xtr, _ = fake_images(rng, 6)
    xte, _ = fake_images(rng, 2)
    ytr = rng.integers(1, 27, size=6, dtype=np.uint8)  # letters are labelled 1..26
    yte = np.array([1, 26], dtype=np.uint8)
    names = [
        f"emnist-letters-{part}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
        for part in ("train", "test")
        for kind in ("images", "labels")
    ]
    write_idx_set(tmp_path / "emnist-letters", names, [xtr, ytr, xte, yte], gz=True)
    ds = load_dataset("emnist-letters", tmp_path)
    assert ds.num_classes == 26
    assert torch.equal(ds.y_train, torch.from_numpy(ytr.astype(np.int64) - 1))
    assert ds.y_test.tolist() == [0, 25]
    raw = xtr.astype(np.float64) / 255.0
    expected = (raw.transpose(0, 2, 1) - raw.mean()) / raw.std()
    np.testing.assert_allclose(ds.x_train[:, 0].double().numpy(), expected, atol=1e-5)


def test_read_idx_other_dtypes_and_bad_files(tmp_path: Path) -> None:
    for dtype in (np.int16, np.int32, np.float32, np.float64, np.uint8):
        array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
        path = tmp_path / f"a{np.dtype(dtype).name}.gz"
        write_idx(path, array)
        assert np.array_equal(read_idx(path), array)
        # the header is the published one: 0, 0, type code, ndim, big-endian dims
        assert gzip.decompress(path.read_bytes())[:4] == bytes([0, 0, path_code(dtype), 3])
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(BatchboundError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(idx_bytes(np.zeros((3, 2), np.uint8))[:-1])
    with pytest.raises(BatchboundError, match="IDX header says shape"):
        read_idx(tmp_path / "short")


def path_code(dtype) -> int:
    return {np.uint8: 0x08, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}[
        dtype
    ]


def write_cifar(directory: Path, files: dict[str, tuple[np.ndarray, dict[bytes, list]]]) -> None:
    directory.mkdir(parents=True)
    for name, (data, labels) in files.items():
        batch = {b"batch_label": b"testing", b"data": data, **labels}
        with open(directory / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)


def test_cifar10_python_batches(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    files, all_labels = {}, []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=4).tolist()
        files[name] = (data, {b"labels": labels})
        all_labels.append(labels)
    write_cifar(tmp_path / "cifar-10-batches-py", files)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.n_train == 20 and ds.n_test == 4 and ds.input_shape == (3, 32, 32)
    assert ds.y_train.tolist() == [label for batch in all_labels[:5] for label in batch]
    assert ds.y_test.tolist() == all_labels[5]
    # channel-major rows; per-channel standardisation with training statistics
    train = np.concatenate([files[f"data_batch_{i}"][0] for i in range(1, 6)])
    train = train.reshape(-1, 3, 32, 32) / 255.0
    mean, std = train.mean(axis=(0, 2, 3)), train.std(axis=(0, 2, 3))
    np.testing.assert_allclose(ds.meta["mean"], mean, rtol=1e-6)
    expected = (train - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(ds.x_train.double().numpy(), expected, atol=1e-5)


def test_cifar100_fine_and_coarse(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    files = {}
    for name, n in (("train", 6), ("test", 3)):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = rng.integers(0, 100, size=n).tolist()
        coarse = rng.integers(0, 20, size=n).tolist()
        files[name] = (data, {b"fine_labels": fine, b"coarse_labels": coarse})
    write_cifar(tmp_path / "cifar100" / "cifar-100-python", files)
    fine = load_dataset("cifar100", tmp_path)
    assert fine.num_classes == 100 and fine.y_train.tolist() == files["train"][1][b"fine_labels"]
    coarse = load_dataset("cifar100(labels=coarse)", tmp_path)
    assert coarse.num_classes == 20
    assert coarse.y_test.tolist() == files["test"][1][b"coarse_labels"]
    with pytest.raises(BatchboundError, match="fine or coarse"):
        load_dataset("cifar100(labels=medium)", tmp_path)


def test_libsvm_train_and_test_files(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text(
        "+1 1:0.5 3:-1\n-1 2:2.0\n+1 1:1 2:1 3:1 # a comment\n-1 3:0.25\n"
    )
    (tmp_path / "test.txt").write_text("-1 1:3\n+1 2:-0.5\n")
    ds = load_dataset("libsvm(path=train.txt,test=test.txt)", tmp_path)
    assert ds.task == "classification" and ds.num_classes == 2
    expected = [[0.5, 0, -1], [0, 2, 0], [1, 1, 1], [0, 0, 0.25]]
    np.testing.assert_array_equal(ds.x_train.numpy(), np.array(expected, np.float32))
    assert ds.y_train.tolist() == [1, 0, 1, 0] and ds.y_test.tolist() == [0, 1]
    np.testing.assert_array_equal(ds.x_test.numpy(), [[3, 0, 0], [0, -0.5, 0]])
    assert ds.meta["label_values"] == [-1.0, 1.0]


def test_libsvm_split_and_regression(tmp_path: Path) -> None:
    lines = [f"{0.5 * i} 1:{i} 2:{i * i}" for i in range(20)]
    (tmp_path / "reg.txt").write_text("\n".join(lines) + "\n")
    ds = load_dataset(f"libsvm(path={tmp_path / 'reg.txt'})")
    assert ds.task == "regression" and ds.n_train == 16 and ds.n_test == 4
    # the split is a permutation of the rows, labels still attached to their features
    x = torch.cat([ds.x_train, ds.x_test])
    y = torch.cat([ds.y_train, ds.y_test])[:, 0]
    assert torch.equal(y * 2, x[:, 0]) and sorted(x[:, 0].tolist()) == list(range(20))
    again = load_dataset(f"libsvm(path={tmp_path / 'reg.txt'})")
    assert torch.equal(again.x_train, ds.x_train)


def test_gisette(tmp_path: Path) -> None:
    directory = tmp_path / "gisette"
    directory.mkdir()
    directory.joinpath("gisette_scale").write_text("1 1:-1 5000:0.5\n-1 2:0.25\n")
    # the LIBSVM page ships gisette bz2-compressed; the reader takes either form
    directory.joinpath("gisette_scale.t.bz2").write_bytes(bz2.compress(b"-1 4999:1\n"))
    ds = load_dataset("gisette", tmp_path)
    assert ds.input_shape == (5000,) and ds.y_train.tolist() == [1, 0] and ds.y_test.tolist() == [0]
    assert ds.x_train[0, 4999] == 0.5 and ds.x_test[0, 4998] == 1


def test_npz_with_and_without_test_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(30, 2, 3)), rng.integers(0, 3, size=30)
    np.savez(tmp_path / "a.npz", x=x, y=y, x_test=x[:4], y_test=y[:4])
    ds = load_dataset("npz(path=a.npz)", tmp_path)
    assert ds.input_shape == (2, 3) and ds.num_classes == 3 and ds.n_test == 4
    assert torch.equal(ds.y_train, torch.from_numpy(y)) and ds.x_train.dtype == torch.float32
    np.savez(tmp_path / "b.npz", x=x, y=y.astype(np.float64) + 0.5)
    reg = load_dataset("npz(path=b.npz)", tmp_path)
    assert reg.task == "regression" and reg.n_train + reg.n_test == 30
    assert reg.y_train.shape == (24, 1)
    np.savez(tmp_path / "c.npz", x=x)
    with pytest.raises(BatchboundError, match="no array 'y'"):
        load_dataset("npz(path=c.npz)", tmp_path)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("mnist", r"train-images-idx3-ubyte.*not found in .*mnist"),
        ("cifar10", r"data_batch_1.*cifar-10-batches-py"),
        ("cifar100", r"cifar-100-python"),
        ("gisette", r"gisette_scale, gisette_scale.t"),
        ("emnist-balanced", r"emnist-balanced-train-images-idx3-ubyte"),
        ("libsvm", r"needs path=FILE"),
        ("npz(path=nothing.npz)", r"'nothing.npz' not found"),
    ],
)
def test_missing_files_name_what_is_needed(tmp_path: Path, spec: str, match: str) -> None:
    with pytest.raises(BatchboundError, match=match):
        load_dataset(spec, tmp_path)


def test_partial_directory_names_the_missing_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    xtr, ytr = fake_images(rng, 3)
    write_idx_set(tmp_path / "kmnist", IDX_NAMES[:2], [xtr, ytr], gz=True)
    pattern = r"kmnist lacks t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"
    with pytest.raises(BatchboundError, match=pattern):
        load_dataset("kmnist", tmp_path)


def test_labels_outside_the_class_range_are_rejected(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    (xtr, ytr), (xte, yte) = fake_images(rng, 4), fake_images(rng, 2)
    ytr[0] = 46  # an EMNIST-balanced label in an MNIST directory
    write_idx_set(tmp_path / "mnist", IDX_NAMES, [xtr, ytr, xte, yte], gz=False)
    with pytest.raises(BatchboundError, match=r"labels run from \d+ to 46; mnist has 10 classes"):
        load_dataset("mnist", tmp_path)
