"""The registry: embedded sets load offline and match the facts `data list` prints; options,
unknown names and the real Fashion-MNIST files."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from batchbound.data import dataset_names, get_entry, load_dataset, resolve_data_dir
from batchbound.data.files import DEBIAN_FASHION_MNIST
from batchbound.data.splits import stratified_split
from batchbound.errors import BatchboundError

EMBEDDED = ["digits", "mnist5k", "mnist1d", "synthetic-linear", "synthetic-logistic"]


@pytest.fixture(scope="module")
def embedded() -> dict:
    return {name: load_dataset(name) for name in EMBEDDED}


def test_every_embedded_set_is_registered_and_available() -> None:
    registered = [n for n in dataset_names() if get_entry(n).embedded]
    assert sorted(registered) == sorted(EMBEDDED)
    for name in EMBEDDED:
        assert get_entry(name).missing() is None


@pytest.mark.parametrize("name", EMBEDDED)
def test_static_facts_match_the_loaded_set(embedded: dict, name: str) -> None:
    ds, entry = embedded[name], get_entry(name)
    assert (ds.n_train, ds.n_test) == (entry.n_train, entry.n_test)
    assert ds.input_shape == entry.input_shape
    assert ds.task == entry.task and ds.num_classes == entry.classes
    assert ds.x_train.dtype == torch.float32 and torch.isfinite(ds.x_train).all()
    if ds.task == "classification":
        assert ds.y_train.dtype == torch.int64 and ds.y_train.dim() == 1
        assert int(ds.y_train.min()) >= 0 and int(ds.y_train.max()) < ds.num_classes
        assert len(torch.unique(ds.y_train)) == ds.num_classes


def test_mnist5k_split_is_stratified_deterministic_and_standardised(embedded: dict) -> None:
    ds = embedded["mnist5k"]
    assert torch.bincount(ds.y_test).tolist() == [100] * 10
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-3
    # the mean/std of real MNIST pixels, as every MNIST pipeline uses them
    assert ds.meta["mean"] == pytest.approx(0.1307, abs=2e-3)
    assert len(torch.unique(ds.y_train[:50])) > 5  # shuffled, not stored class by class
    labels = np.repeat(np.arange(10), 50)
    first, again, other = (stratified_split(labels, 0.2, s) for s in (0, 0, 1))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[1], other[1])
    assert sorted(np.concatenate(first).tolist()) == list(range(500))
    assert np.bincount(labels[first[1]]).tolist() == [10] * 10


def test_mnist1d_leaves_global_random_state_alone(embedded: dict) -> None:
    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    small = load_dataset("mnist1d(num_samples=200,seed=3)")
    assert (np.random.rand(), random.random()) == expected
    assert small.n_train == 160 and small.input_shape == (1, 40)
    assert not torch.equal(small.x_train[:5], embedded["mnist1d"].x_train[:5])


def test_synthetic_linear_options_and_teacher() -> None:
    ds = load_dataset("synthetic-linear(n=300,d=7,outputs=3,depth=2,width=5,seed=4,n_test=10)")
    assert (ds.n_train, ds.n_test, ds.input_shape, ds.num_outputs) == (300, 10, (7,), 3)
    x = torch.cat([ds.x_train, ds.x_test]).double()
    y = torch.cat([ds.y_train, ds.y_test]).double()
    # labels are an exact linear function of x (a product of teacher matrices) of rank <= 3
    coef = torch.linalg.lstsq(x, y).solution
    assert torch.allclose(x @ coef, y, atol=1e-4)
    assert torch.equal(load_dataset("synthetic-linear(seed=4)").x_train,
                       load_dataset("synthetic-linear(seed=4)").x_train)  # fmt: skip
    with pytest.raises(BatchboundError, match="depth must be >= 1"):
        load_dataset("synthetic-linear(depth=0)")


def test_synthetic_logistic_follows_its_linear_model() -> None:
    hard = load_dataset("synthetic-logistic(n=2000,d=10,scale=inf,seed=2)")
    w = torch.tensor(hard.meta["w_star"], dtype=torch.float64)
    assert torch.linalg.norm(w) == pytest.approx(1.0)
    assert torch.equal(hard.y_train, (hard.x_train.double() @ w > 0).long())
    soft = load_dataset("synthetic-logistic(n=20000,d=10,scale=2.0,seed=2)")
    margin = soft.x_train.double() @ torch.tensor(soft.meta["w_star"], dtype=torch.float64)
    # mean label matches mean P(y=1|x) within Monte Carlo error (sd ~ 0.0035)
    expected = torch.sigmoid(2.0 * margin).mean()
    assert abs(float(soft.y_train.double().mean() - expected)) < 0.015
    with pytest.raises(BatchboundError, match="scale must be > 0"):
        load_dataset("synthetic-logistic(scale=0)")


def test_digits_image_option(embedded: dict) -> None:
    image = load_dataset("digits(image=true)")
    assert image.input_shape == (1, 8, 8)
    assert torch.equal(image.x_train.flatten(1), embedded["digits"].x_train)


def test_digits_are_scikit_learns_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from scikit-learn's bundled file without importing sklearn.datasets: the same
    arrays as load_digits, and the same from the fallback (load_digits itself)."""
    from sklearn.datasets import load_digits as sk_load

    from batchbound.data import embedded

    bunch = sk_load()
    read = embedded.digits_arrays()
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    for pixels, labels in (read, embedded.digits_arrays()):
        assert pixels.dtype == bunch.data.dtype and labels.dtype == bunch.target.dtype
        assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)


def test_unknown_names_and_options_are_errors() -> None:
    with pytest.raises(BatchboundError,
                       match=r"unknown data set 'mnst' \(did you mean 'mnist'\?\); available: "
                       r".*mnist5k"):
        load_dataset("mnst")
    with pytest.raises(BatchboundError, match=r"no option 'colour'; options: n, d"):
        load_dataset("synthetic-linear(colour=3)")
    with pytest.raises(BatchboundError, match=r"option n must be int, got 2.5"):
        load_dataset("synthetic-linear(n=2.5)")
    with pytest.raises(BatchboundError, match=r"option image must be bool, got 'yes'"):
        load_dataset("digits(image=yes)")
    assert load_dataset("synthetic-linear(n=10,noise=1)").n_train == 10  # int where float goes


def test_data_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHBOUND_DATA", str(tmp_path / "env"))
    assert resolve_data_dir(None) == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("BATCHBOUND_DATA")
    assert resolve_data_dir(None) == Path("~/.cache/batchbound/data").expanduser()


@pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").exists(),
    reason="real Fashion-MNIST not installed: sudo apt-get install dataset-fashion-mnist "
    "(Debian package dataset-fashion-mnist)",
)
def test_real_fashion_mnist_from_the_debian_package(tmp_path: Path) -> None:
    ds = load_dataset("fashion-mnist", tmp_path)  # empty data dir: falls back to Debian's copy
    assert (ds.n_train, ds.n_test, ds.input_shape) == (60_000, 10_000, (1, 28, 28))
    assert torch.bincount(ds.y_train).tolist() == [6000] * 10
    assert torch.bincount(ds.y_test).tolist() == [1000] * 10
    # Fashion-MNIST's published pixel statistics
    assert ds.meta["mean"][0] == pytest.approx(0.2860, abs=1e-4)
    assert ds.meta["std"][0] == pytest.approx(0.3530, abs=1e-4)
    assert get_entry("fashion-mnist").missing(tmp_path) is None
