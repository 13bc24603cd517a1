"""Bad data files, the way a user hands them over: ``--dataset npz(path=...)``,
``libsvm(path=...)``, ``text(path=...)`` and the files under ``--data-dir`` (IDX for the MNIST
family, CIFAR python batches). Each case writes one broken file and runs
``batchbound data show SPEC --load`` (the cheapest command that loads a set; ``measure`` and
``train`` load through the same ``load_dataset``); every one must end in one line naming the
problem, exit code 2, no traceback and no silent acceptance.
"""

from __future__ import annotations

import bz2
import gzip
import io
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from bad_input import BAD_INPUT, refused

# a warning would be a second line on stderr: here it fails the case
pytestmark = [BAD_INPUT, pytest.mark.filterwarnings("error")]

Build = Callable[[Path], list[str]]  # writes the bad file(s) under tmp_path, returns argv

RNG = np.random.default_rng(0)
X = RNG.normal(size=(10, 3))
Y = np.arange(10) % 2


def show(tmp: Path, spec: str) -> list[str]:
    return ["data", "show", spec, "--load", "--data-dir", str(tmp)]


def case(build: Build, match: str, id: str) -> object:
    return pytest.param(build, match, id=id)


# --------------------------------------------------------------------------- npz


def npz(spec_options: str = "", **arrays: object) -> Build:
    def build(tmp: Path) -> list[str]:
        np.savez(tmp / "d.npz", **arrays)  # np.savez pickles object arrays: a hostile file
        return show(tmp, f"npz(path=d.npz{spec_options})")

    return build


def raw(name: str, data: bytes | Callable[[], bytes], spec: str) -> Build:
    def build(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(data() if callable(data) else data)
        return show(tmp, spec)

    return build


def with_nan(a: np.ndarray, value: float = np.nan) -> np.ndarray:
    a = a.astype(np.float64)
    a.flat[3] = value
    return a


def npz_bytes(**arrays: object) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def zip_with_raw_member() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("x", b"not an array")
        archive.writestr("y.npy", npy_bytes(Y))
    return buffer.getvalue()


STRUCTURED = np.zeros(10, dtype=[("a", "f4"), ("b", "i4")])
NPZ = "npz(path=d.npz)"

NPZ_CASES = [
    case(npz(y=Y), r"no array 'x'", "npz-missing-x"),
    case(npz(x=X), r"no array 'y'", "npz-missing-y"),
    case(npz(), r"no array 'x'", "npz-no-arrays"),
    case(npz(x=X, y=Y, x_test=X), r"both x_test and y_test", "npz-x-test-without-y-test"),
    case(npz(x=X.astype(object), y=Y), r"'x' cannot be read: Object arrays", "npz-object-x"),
    case(npz(x=X, y=Y.astype(object)), r"'y' cannot be read: Object arrays", "npz-object-y"),
    case(npz(x=np.float64(3.0), y=Y), r"x .* single value \(0-d\)", "npz-0d-x"),
    case(npz(x=X, y=np.int64(1)), r"y .* single value \(0-d\)", "npz-0d-y"),
    case(npz(x=np.zeros((0, 3)), y=np.zeros(0)), r"0 training example", "npz-zero-rows"),
    case(npz(x=np.zeros((1, 3)), y=np.zeros(1)), r"1 training example", "npz-one-row"),
    case(npz(",test_fraction=0.8", x=X[:3], y=Y[:3]), r"leaves 1 of 3", "npz-split-leaves-one"),
    case(npz(x=X, y=np.array(["cat", "dog"] * 5)), r"dtype <U3.*class names", "npz-string-y"),
    case(npz(x=X, y=np.array([b"a", b"b"] * 5)), r"dtype \|S1", "npz-bytes-y"),
    case(npz(x=X.astype(str), y=Y), r"x .* dtype <U", "npz-string-x"),
    case(npz(x=X + 1j, y=Y), r"x .* dtype complex128", "npz-complex-x"),
    case(npz(x=X, y=Y + 0.5j), r"y .* dtype complex128", "npz-complex-y"),
    case(npz(x=STRUCTURED.reshape(10, 1), y=Y), r"x .* needs real numbers", "npz-structured-x"),
    case(npz(x=np.zeros((10, 2), "datetime64[s]"), y=Y), r"needs real numbers", "npz-datetime-x"),
    case(npz(x=with_nan(X), y=Y), r"NaN or infinite", "npz-nan-x"),
    case(npz(x=with_nan(X, np.inf), y=Y), r"NaN or infinite", "npz-inf-x"),
    case(npz(x=with_nan(X, -np.inf), y=Y), r"NaN or infinite", "npz-minus-inf-x"),
    case(npz(x=X * 1e300, y=Y), r"NaN or infinite", "npz-x-beyond-float32"),
    case(npz(x=X, y=with_nan(X[:, 0])), r"targets have NaN or infinite", "npz-nan-targets"),
    case(npz(x=X, y=with_nan(X[:, 0], np.inf)), r"targets have NaN or inf", "npz-inf-targets"),
    case(
        npz(",task=regression", x=X, y=X[:, 0] * 1e300),
        r"targets have NaN or inf",
        "npz-targets-beyond-float32",
    ),
    case(
        npz(",task=classification", x=X, y=with_nan(Y)),
        r"needs integer labels",
        "npz-nan-class-labels",
    ),
    case(npz(x=X, y=Y[:9]), r"x has 10 rows but y has 9", "npz-mismatched-rows"),
    case(
        npz(x=X, y=Y, x_test=X[:4], y_test=Y[:3]),
        r"x_test has 4 rows but y_test has 3",
        "npz-mismatched-test-rows",
    ),
    case(npz(x=X[:, 0], y=Y), r"shape \(10,\).*reshape\(-1, 1\)", "npz-1d-x"),
    case(npz(x=np.zeros((10, 0)), y=Y), r"shape \(10, 0\)", "npz-no-features"),
    case(npz(x=np.zeros((10, 3, 0)), y=Y), r"shape \(10, 3, 0\)", "npz-empty-feature-axis"),
    case(
        npz(x=X, y=Y, x_test=np.zeros((4, 5)), y_test=Y[:4]),
        r"test inputs have shape \(5,\)",
        "npz-test-feature-mismatch",
    ),
    case(
        npz(x=X, y=X[:, :2], x_test=X[:4], y_test=X[:4]),
        r"2 columns, test targets 3",
        "npz-target-width-mismatch",
    ),
    case(
        npz(",task=classification", x=X, y=X[:, 0]),
        r"needs integer labels",
        "npz-classification-float-labels",
    ),
    case(npz(",task=bogus", x=X, y=Y), r"task must be auto", "npz-unknown-task"),
    case(npz(",test_fraction=1.5", x=X, y=Y), r"test_fraction must be in", "npz-test-fraction"),
    case(raw("d.npz", b"garbage, not a zip", NPZ), r"not a readable \.npz archive: not a zip",
         "npz-garbage"),
    case(raw("d.npz", b"", NPZ), r"not a readable \.npz", "npz-empty-file"),
    case(
        raw("d.npz", lambda: npz_bytes(x=X, y=Y)[:300], NPZ),
        r"not a readable \.npz",
        "npz-truncated",
    ),
    case(
        raw("d.npz", lambda: npz_bytes(x=X, y=Y)[:-40], NPZ),
        r"not a readable \.npz",
        "npz-truncated-directory",
    ),
    case(raw("d.npz", lambda: npy_bytes(X), NPZ), r"single array \(\.npy\)", "npz-is-npy"),
    case(
        raw("d.npz", pickle.dumps({"x": X, "y": Y}), NPZ),
        r"not a readable \.npz archive: not a zip file; write one with np\.savez",
        "npz-is-pickle",
    ),
    case(raw("d.npz", zip_with_raw_member, NPZ), r"'x' is not a \.npy array", "npz-raw-zip-member"),
    case(lambda tmp: show(tmp, "npz(path=nope.npz)"), r"file 'nope.npz' not found", "npz-no-file"),
    case(lambda tmp: show(tmp, f"npz(path={tmp})"), r"is a directory .*; give a file",
         "npz-path-is-directory"),
    case(lambda tmp: show(tmp, "npz"), r"needs path=FILE", "npz-no-path"),
]


# --------------------------------------------------------------------------- LIBSVM

SVM = "libsvm(path=d.txt)"


def svm(text: bytes, name: str = "d.txt", spec: str = SVM) -> Build:
    return raw(name, text, spec)


def with_test(train: bytes, test: bytes) -> Build:
    def build(tmp: Path) -> list[str]:
        (tmp / "a.txt").write_bytes(train)
        (tmp / "b.txt").write_bytes(test)
        return show(tmp, "libsvm(path=a.txt,test=b.txt)")

    return build


GOOD_SVM = b"1 1:0.5 2:1\n0 1:1 3:2\n1 2:1\n0 3:1\n1 1:2\n"

LIBSVM_CASES = [
    case(svm(b""), r"no examples", "libsvm-empty"),
    case(svm(b"# a comment\n# another\n"), r"no examples", "libsvm-comments-only"),
    case(svm(b"\n  \n\n"), r"no examples", "libsvm-blank-lines"),
    case(svm(b"1 1000000000000:1\n0 1:1\n"), r"feature index is too large", "libsvm-index-1e12"),
    case(svm(b"1 1000000000:1\n0 1:1\n1 2:1\n"), r"dense values, more than", "libsvm-index-1e9"),
    case(svm(b"1 a:b\n"), r"not a LIBSVM/SVMlight file", "libsvm-non-numeric-pair"),
    case(svm(b"1 3\n"), r"not a LIBSVM/SVMlight file", "libsvm-missing-colon"),
    case(svm(b"1 -3:1\n"), r"not a LIBSVM/SVMlight file.*-3", "libsvm-negative-index"),
    case(svm(b"cat 1:2\n"), r"not a LIBSVM/SVMlight file", "libsvm-word-label"),
    case(svm(b"1 3:1 3:2\n"), r"sorted and unique", "libsvm-duplicate-index"),
    case(svm(b"1 1:nan\n0 1:1\n1 1:2\n"), r"NaN or infinite", "libsvm-nan-value"),
    case(svm(b"1 1:inf\n0 1:1\n1 1:2\n"), r"NaN or infinite", "libsvm-inf-value"),
    case(svm(b"1 1:1e400\n0 1:1\n1 1:2\n"), r"NaN or infinite", "libsvm-value-beyond-float"),
    case(
        svm(b"1e400 1:1\n0 1:1\n1 1:2\n0 1:3\n"),
        r"targets have NaN or inf",
        "libsvm-infinite-label",
    ),
    case(svm(bytes(range(256)) * 4), r"not a LIBSVM/SVMlight file", "libsvm-binary-garbage"),
    case(svm(b"1 1:\xff\xfe\n"), r"not a LIBSVM/SVMlight file", "libsvm-bad-bytes"),
    case(svm(b"1 1:1\n"), r"1 training example", "libsvm-one-example"),
    case(
        svm(gzip.compress(GOOD_SVM * 50)[:40], "d.txt.gz", "libsvm(path=d.txt.gz)"),
        r"not a LIBSVM/SVMlight file.*ended",
        "libsvm-truncated-gz",
    ),
    case(
        svm(GOOD_SVM, "d.txt.gz", "libsvm(path=d.txt.gz)"), r"Not a gzipped file", "libsvm-not-gzip"
    ),
    case(
        svm(b"garbage", "d.txt.bz2", "libsvm(path=d.txt.bz2)"),
        r"Invalid data stream",
        "libsvm-bad-bz2",
    ),
    case(
        svm(bz2.compress(GOOD_SVM)[:30], "d.txt.bz2", "libsvm(path=d.txt.bz2)"),
        r"not a LIBSVM/SVMlight file",
        "libsvm-truncated-bz2",
    ),
    case(with_test(GOOD_SVM, b"1 9:1\n"), r"not a LIBSVM/SVMlight file", "libsvm-test-wider"),
    case(with_test(GOOD_SVM, b""), r"b\.txt: no examples", "libsvm-test-empty"),
    case(with_test(GOOD_SVM, b"x y z\n"), r"b\.txt: not a LIBSVM", "libsvm-test-garbage"),
    case(lambda tmp: show(tmp, "libsvm(path=nope.txt)"), r"not found", "libsvm-no-file"),
    case(lambda tmp: show(tmp, "libsvm"), r"needs path=FILE", "libsvm-no-path"),
]


# --------------------------------------------------------------------------- IDX (MNIST)

IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    big = {0x08: ">u1", 0x0D: ">f4"}[code]
    return header + array.astype(big).tobytes()


def good_idx() -> list[bytes]:
    images = RNG.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    labels = np.array([0, 3, 9, 1], dtype=np.uint8)
    return [idx_bytes(images), idx_bytes(labels), idx_bytes(images[:2]), idx_bytes(labels[:2])]


def mnist(which: int, payload: bytes | Callable[[bytes], bytes], gz: bool = True) -> Build:
    """An MNIST set in DIR/mnist/ (gzipped) whose file ``which`` is replaced by ``payload``
    (or ``payload(good bytes)``, raw; gzipped after that when ``gz``)."""

    def build(tmp: Path) -> list[str]:
        folder = tmp / "mnist"
        folder.mkdir()
        for index, (name, data) in enumerate(zip(IDX_NAMES, good_idx(), strict=True)):
            if index == which:
                data = payload(data) if callable(payload) else payload
                (folder / f"{name}.gz").write_bytes(gzip.compress(data) if gz else data)
            else:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        return show(tmp, "mnist")

    return build


def missing_mnist_file(tmp: Path) -> list[str]:
    folder = tmp / "mnist"
    folder.mkdir()
    for name, data in zip(IDX_NAMES[:3], good_idx(), strict=False):
        (folder / f"{name}.gz").write_bytes(gzip.compress(data))
    return show(tmp, "mnist")


NAN_IMAGES = np.full((4, 28, 28), np.nan, dtype=np.float32)

IDX_CASES = [
    case(
        mnist(0, lambda good: gzip.compress(good)[:100], gz=False),
        r"cannot be read as IDX",
        "idx-truncated-gz",
    ),
    case(
        mnist(1, lambda good: good, gz=False),
        r"cannot be read as IDX.*Not a gzipped file",
        "idx-not-gzip",
    ),
    case(
        mnist(2, b"", gz=False), r"cannot be read as IDX|bad magic number empty", "idx-zero-byte-gz"
    ),
    case(
        mnist(2, gzip.compress(b"")[:-3], gz=False),
        r"cannot be read as IDX",
        "idx-gz-without-trailer",
    ),
    case(mnist(0, b""), r"bad magic number empty", "idx-empty"),
    case(mnist(0, b"GIF89a and more"), r"not an IDX file \(bad magic", "idx-bad-magic"),
    case(
        mnist(0, lambda good: b"\x00\x00\x07" + good[3:]),
        r"not an IDX file",
        "idx-unknown-type-code",
    ),
    case(
        mnist(0, lambda good: good[:-1]),
        r"IDX header says shape \(4, 28, 28\)",
        "idx-short-payload",
    ),
    case(
        mnist(0, lambda good: good + b"\x00"),
        r"IDX header says .* has more bytes",
        "idx-extra-bytes",
    ),
    case(
        mnist(0, b"\x00\x00\x08\xc8\x00\x00"),
        r"ends inside its header \(200 dims\)",
        "idx-header-ndim-200",
    ),
    case(
        mnist(0, b"\x00\x00\x08\x03" + b"\xff" * 12 + b"\x00" * 10),
        r"IDX header's shape \(4294967295, 4294967295, 4294967295\) would be 7.92e\+28 values",
        "idx-header-claims-huge",
    ),
    case(
        mnist(1, idx_bytes(np.zeros((4, 1), np.uint8))),
        r"1-d array of integer labels",
        "idx-labels-2d",
    ),
    case(mnist(1, idx_bytes(np.zeros(4, np.float32), 0x0D)), r"integer labels", "idx-labels-float"),
    case(
        mnist(0, idx_bytes(np.zeros((4, 784), np.uint8))),
        r"expected \(n, H, W\) images",
        "idx-images-2d",
    ),
    case(
        mnist(0, idx_bytes(np.zeros((3, 28, 28), np.uint8))),
        r"matching 4 labels",
        "idx-count-mismatch",
    ),
    case(
        mnist(1, idx_bytes(np.array([0, 1, 10, 2], np.uint8))),
        r"labels run from 0 to 10",
        "idx-label-out-of-range",
    ),
    case(mnist(0, idx_bytes(NAN_IMAGES, 0x0D)), r"NaN or infinite", "idx-nan-float-images"),
    case(missing_mnist_file, r"lacks t10k-labels-idx1-ubyte", "idx-missing-file"),
]


# --------------------------------------------------------------------------- CIFAR

CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def cifar_batch(n: int = 4, **changes: object) -> dict:
    batch = {
        b"batch_label": b"testing",
        b"data": RNG.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"labels": RNG.integers(0, 10, size=n).tolist(),
    }
    batch.update({key.encode(): value for key, value in changes.items()})
    return {k: v for k, v in batch.items() if v is not None}


def cifar(payload: bytes | Callable[[], bytes], which: str = "data_batch_3") -> Build:
    """A CIFAR-10 folder whose file ``which`` holds ``payload`` (None: the file is left out)."""

    def build(tmp: Path) -> list[str]:
        folder = tmp / "cifar-10-batches-py"
        folder.mkdir()
        for name in CIFAR10:
            if name == which:
                if payload is not None:
                    (folder / name).write_bytes(payload() if callable(payload) else payload)
            else:
                (folder / name).write_bytes(pickle.dumps(cifar_batch(), protocol=2))
        return show(tmp, "cifar10")

    return build


def pickled(value: object) -> Callable[[], bytes]:
    return lambda: pickle.dumps(value, protocol=2)


class CallsEval:
    def __reduce__(self) -> tuple:
        return (eval, ("1 + 1",))


CIFAR_CASES = [
    case(cifar(None), r"lacks data_batch_3", "cifar-missing-file"),
    case(cifar(b""), r"not a CIFAR python batch \(unreadable pickle", "cifar-empty"),
    case(cifar(bytes(range(256))), r"not a CIFAR python batch", "cifar-garbage"),
    case(
        cifar(lambda: pickle.dumps(cifar_batch(), protocol=2)[:5000]),
        r"not a CIFAR python batch \(unreadable",
        "cifar-truncated",
    ),
    case(cifar(pickled([1, 2, 3])), r"holds list", "cifar-list"),
    case(cifar(pickled(7)), r"holds int", "cifar-int"),
    case(
        cifar(pickled(cifar_batch(labels=None))),
        r"expected a dict with b'data' and b'labels'",
        "cifar-no-labels",
    ),
    case(cifar(pickled(cifar_batch(data=None))), r"expected a dict with b'data'", "cifar-no-data"),
    case(
        cifar(pickled(cifar_batch(data=np.zeros((4, 100), np.uint8)))),
        r"shape \(n, 3072\)",
        "cifar-data-wrong-width",
    ),
    case(
        cifar(pickled(cifar_batch(data=np.zeros((4, 3072)) + 300))),
        r"float64 array",
        "cifar-data-float",
    ),
    case(
        cifar(pickled(cifar_batch(data=[[0] * 3072] * 4))), r"b'data' is a list", "cifar-data-list"
    ),
    case(
        cifar(pickled(cifar_batch(labels=[1, 2, 3]))),
        r"must be 4 integer labels",
        "cifar-label-count",
    ),
    case(
        cifar(pickled(cifar_batch(labels=["cat"] * 4))),
        r"must be 4 integer labels",
        "cifar-string-labels",
    ),
    case(
        cifar(pickled(cifar_batch(labels=[0, 1, 10, 2]))),
        r"labels run from 0 to 10",
        "cifar-label-too-large",
    ),
    case(
        cifar(pickled(cifar_batch(labels=[0, -1, 3, 2]))),
        r"labels run from -1 to 3",
        "cifar-negative-label",
    ),
    case(
        cifar(pickled(cifar_batch(labels=[[0, 1]] * 4))),
        r"must be 4 integer labels",
        "cifar-nested-labels",
    ),
    case(
        cifar(pickled(CallsEval())),
        r"refused: the pickle calls (__builtin__|builtins)\.eval",
        "cifar-calls-eval",
    ),
]


# --------------------------------------------------------------------------- text, data dir

TEXT_CASES = [
    case(raw("t.txt", b"\xff\xfe\x00binary", "text(path=t.txt)"), r"not UTF-8", "text-binary"),
    case(raw("t.txt", b"", "text(path=t.txt)"), r"0 characters", "text-empty"),
    case(raw("t.txt", b"short\n", "text(path=t.txt)"), r"fewer than context", "text-too-short"),
    case(lambda tmp: show(tmp / "absent", "mnist"), r"not found in", "data-dir-missing"),
    case(lambda tmp: show(touch(tmp / "f"), "cifar10"), r"not found in", "data-dir-is-a-file"),
]


def touch(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("build", "match"), NPZ_CASES + LIBSVM_CASES + IDX_CASES + CIFAR_CASES + TEXT_CASES
)
def test_bad_data_file_is_refused(
    build: Build, match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(build(tmp_path), match, capsys)


def test_the_cases_are_distinct() -> None:
    cases = NPZ_CASES + LIBSVM_CASES + IDX_CASES + CIFAR_CASES + TEXT_CASES
    ids = [c.id for c in cases]  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids))


def test_the_same_files_load_when_intact(tmp_path: Path) -> None:
    """The builders' good files load, so each case fails for its one defect only."""
    from batchbound.data import load_dataset

    np.savez(tmp_path / "d.npz", x=X, y=Y)
    assert load_dataset(NPZ, tmp_path).n_train == 8
    (tmp_path / "d.txt").write_bytes(GOOD_SVM)
    assert load_dataset(SVM, tmp_path).n_train == 4
    mnist(0, lambda good: good)(tmp_path)
    assert load_dataset("mnist", tmp_path).n_train == 4
    cifar(pickled(cifar_batch()))(tmp_path)
    assert load_dataset("cifar10", tmp_path).n_train == 20
