"""Size bounds for every input format, checked before reading (issue 39), and the small data
sets that used to fail: a one-line error with exit code 2, or a run that completes."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from bad_input import BAD_INPUT, refused

from batchbound.cli import main
from batchbound.data.formats import MAX_PICKLE_BYTES, MAX_SVMLIGHT_BYTES, MAX_TEXT_BYTES

pytestmark = BAD_INPUT
FC = ["--model", "fc(depth=1,width=4)"]


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space (a hole)."""
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


@pytest.mark.parametrize("dataset", ["npz(path={two})", "npz(path={ten},test_fraction=0)",
                                     "npz(path={ten},test_fraction=0.0)"])
def test_tiny_and_unsplit_npz_data_complete(tmp_path, capsys, dataset):
    """Two examples (the 80/20 split leaves no test example), or test_fraction=0 (a
    documented option): "cannot reshape array of size 0" before; now measured and trained."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "two.npz", x=rng.normal(size=(2, 3)), y=np.array([0, 1]))
    np.savez(tmp_path / "ten.npz", x=rng.normal(size=(10, 3)), y=np.arange(10) % 2)
    spec = dataset.format(two=tmp_path / "two.npz", ten=tmp_path / "ten.npz")
    assert main(["measure", *FC, "--dataset", spec]) == 0
    assert main(["train", *FC, "--dataset", spec, "-B", "2", "--max-iterations", "3",
                 "--no-progress", "--json"]) == 0
    from batchbound.data import load_dataset

    data = load_dataset(spec)
    assert data.n_test == 0 and data.n_train in (2, 10)
    assert tuple(data.x_test.shape) == (0, 3)
    capsys.readouterr()


CASES = {
    "synthetic-linear(n=1e12)": (["measure", *FC, "--dataset", "synthetic-linear(n=1e12)"],
                                 r"synthetic-linear: n \+ n_test = 1250000000000 examples .* "
                                 r"more than the .* batchbound holds in memory"),
    "synthetic-logistic(n=1e12)": (["measure", *FC, "--dataset",
                                    "synthetic-logistic(n=1000000000000)"],
                                   r"synthetic-logistic: .* more than"),
    "a wide teacher": (["measure", *FC, "--dataset", "synthetic-linear(width=100000)"],
                       r"a teacher of depth 3 and width 100000"),
    "--seed 1e29": (["measure", *FC, "--seed", str(10**29)],
                    r"argument --seed: 1000+ does not fit in a 64-bit integer"),
    "--seed 1e29 written so": (["measure", *FC, "--seed", "1e29"],
                               r"argument --seed: invalid integer '1e29'"),
    "a data seed past 64 bits": (["measure", *FC, "--dataset",
                                  f"synthetic-linear(seed={10**29})"],
                                 r"option seed=1000+ does not fit in a 64-bit integer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sizes_and_seeds_past_their_bounds_are_one_line(capsys, case):
    argv, match = CASES[case]
    refused(argv, match, capsys)


def _huge_npz(path: Path) -> Path:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (2**31, 4)})
    labels = io.BytesIO()
    np.save(labels, np.zeros(3))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", header.getvalue() + b"\0" * 100)
        archive.writestr("y.npy", labels.getvalue())
    return path


def test_every_file_format_is_bounded_before_reading(tmp_path, capsys):
    text = _sparse(tmp_path / "big.txt", MAX_TEXT_BYTES + 1)
    refused(["measure", "--model", "gpt(layers=1,width=8,heads=1)", "--dataset",
             f"text(path={text})"], r"big\.txt: [\d,]+ bytes, more than the [\d,]+ batchbound "
            r"reads as text", capsys)
    svm = _sparse(tmp_path / "big.svm", MAX_SVMLIGHT_BYTES + 1)
    refused(["measure", *FC, "--dataset", f"libsvm(path={svm})"],
            r"big\.svm: [\d,]+ bytes, more than .* as LIBSVM text", capsys)
    refused(["measure", *FC, "--dataset", f"npz(path={_huge_npz(tmp_path / 'h.npz')})"],
            r"npz: x in .*h\.npz: its shape would be 8\.59e\+09 values", capsys)
    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _sparse(cifar / name, MAX_PICKLE_BYTES + 1)
    refused(["measure", *FC, "--dataset", "cifar10", "--data-dir", str(tmp_path)],
            r"data_batch_1: [\d,]+ bytes, more than .* as a CIFAR python batch", capsys)
    assert os.stat(text).st_blocks == 0  # nothing was written: the bounds came first


def test_a_compressed_idx_file_is_bounded_by_its_header(tmp_path, capsys):
    """A gzipped IDX file is small on disk whatever it holds: its header's shape is checked
    before its payload is read."""
    import gzip

    folder = tmp_path / "mnist"
    folder.mkdir()
    header = bytes([0, 0, 0x08, 3]) + np.array([70000, 40000, 28], ">u4").tobytes()
    for name in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        with gzip.open(folder / f"{name}.gz", "wb") as handle:
            handle.write(header + b"\0" * 1000)
    for name in ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(folder / f"{name}.gz", "wb") as handle:
            handle.write(bytes([0, 0, 0x08, 1]) + np.array([3], ">u4").tobytes() + b"\0" * 3)
    refused(["measure", *FC, "--dataset", "mnist", "--data-dir", str(tmp_path)],
            r"train-images-idx3-ubyte\.gz: its IDX header's shape \(70000, 40000, 28\) would "
            r"be 7\.84e\+10 values", capsys)
