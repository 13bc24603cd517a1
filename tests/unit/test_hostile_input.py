"""Hostile files: nothing a user hands batchbound runs code (issue 14).

CIFAR batches are pickles, read through an unpickler that resolves numpy's array
reconstruction and nothing else; checkpoints are read with ``torch.load(weights_only=True)``;
npz archives with ``allow_pickle=False``. Each crafted file below would write a marker file
(or call ``eval``) if anything in it were executed: each must be refused with one line, and
the marker must not exist afterwards. The genuine formats still load, bit for bit.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input import BAD_INPUT, refused

from batchbound.data import load_dataset
from batchbound.data.formats import read_cifar_batch
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.checkpoint import load_checkpoint, storable
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

pytestmark = BAD_INPUT

CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
RNG = np.random.default_rng(14)


# --------------------------------------------------------------------------- payloads


class System:
    """Unpickles into ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


class Exec:
    """Unpickles into ``exec(source)``: no shell, plain Python."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple:
        return (exec, (self.source,))


class Codecs:
    """The ``_codecs.encode`` a Python 3 pickle of bytes uses, with another codec."""

    def __reduce__(self) -> tuple:
        import codecs

        return (codecs.encode, (b"x\x9c\x03\x00\x00\x00\x00\x01", "zlib"))


def payloads(marker: Path) -> dict[str, object]:
    """Crafted objects, each of which would create ``marker`` when unpickled."""
    return {
        "os.system": System(f"touch '{marker}'"),
        "exec": Exec(f"open({str(marker)!r}, 'w').close()"),
        "inside-a-batch": {b"data": System(f"touch '{marker}'"), b"labels": [0]},
        "as-a-label": {b"data": np.zeros((1, 3072), np.uint8), b"labels": [Exec(
            f"open({str(marker)!r}, 'w').close()")]},
    }  # fmt: skip


PAYLOAD_NAMES = ["os.system", "exec", "inside-a-batch", "as-a-label"]


# --------------------------------------------------------------------------- CIFAR


def write_cifar(folder: Path, batches: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in CIFAR10:
        data = batches.get(name)
        if data is None:
            good = {b"data": RNG.integers(0, 256, (3, 3072), dtype=np.uint8), b"labels": [1, 2, 3]}
            data = pickle.dumps(good, protocol=2)
        (folder / name).write_bytes(data)


@pytest.mark.parametrize("name", PAYLOAD_NAMES)
@pytest.mark.parametrize("protocol", [2, 5])
def test_crafted_cifar_batch_is_refused_without_running(
    tmp_path: Path, name: str, protocol: int, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    crafted = pickle.dumps(payloads(marker)[name], protocol=protocol)
    write_cifar(tmp_path / "cifar-10-batches-py", {"data_batch_2": crafted})
    line = refused(["data", "show", "cifar10", "--load", "--data-dir", str(tmp_path)],
                   r"data_batch_2: refused: the pickle calls \S+", capsys)  # fmt: skip
    assert "nothing in the file is executed" in line
    assert not marker.exists()


@pytest.mark.parametrize(
    ("crafted", "refused_global"),
    [
        (Codecs(), r"_codecs\.encode with 'zlib'"),
        (np.testing.assert_equal, r"numpy\.testing\S*\.assert_equal"),  # a numpy global
        (os.getcwd, r"(posix|os)\.getcwd"),
    ],
)
def test_only_the_globals_cifar_needs_resolve(
    tmp_path: Path, crafted: object, refused_global: str
) -> None:
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(crafted, protocol=2))
    with pytest.raises(BatchboundError, match=refused_global):
        read_cifar_batch(path, b"labels")


def test_numpy_runstring_is_not_reachable(tmp_path: Path) -> None:
    """A hand-written GLOBAL for a numpy helper that runs code is refused like any other."""
    marker = tmp_path / "marker"
    source = f"open({str(marker)!r}, 'w').close()".encode()
    crafted = (
        b"\x80\x02cnumpy.testing._private.utils\nrunstring\n"
        + b"X" + struct.pack("<I", len(source)) + source + b"}\x86R."
    )  # fmt: skip
    path = tmp_path / "batch"
    path.write_bytes(crafted)
    with pytest.raises(BatchboundError, match=r"refused: the pickle calls numpy\.testing"):
        read_cifar_batch(path, b"labels")
    assert not marker.exists()


def py2_cifar_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A CIFAR-10 batch byte for byte as Python 2's cPickle wrote the published files:
    protocol 2, keys and the raw pixels as Python 2 ``str`` (SHORT_BINSTRING/BINSTRING),
    ``numpy.core.multiarray._reconstruct`` and ``numpy.dtype('u1')``, no memo."""

    def string(value: bytes) -> bytes:
        if len(value) < 256:
            return b"U" + bytes([len(value)]) + value
        return b"T" + struct.pack("<i", len(value)) + value

    def integer(value: int) -> bytes:
        return b"J" + struct.pack("<i", value)

    dtype = (
        b"cnumpy\ndtype\n" + string(b"u1") + b"K\x00K\x01\x87R"
        + b"(K\x03" + string(b"|") + b"NNN" + integer(-1) + integer(-1) + b"K\x00tb"
    )  # fmt: skip
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + string(b"b")
        + b"\x87R(K\x01" + integer(data.shape[0]) + integer(data.shape[1]) + b"\x86"
        + dtype + b"\x89" + string(data.tobytes()) + b"tb"
    )  # fmt: skip
    label_list = b"](" + b"".join(integer(v) for v in labels) + b"e"
    return (
        b"\x80\x02}(" + string(b"batch_label") + string(b"training batch 1 of 5")
        + string(b"data") + array + string(b"labels") + label_list + b"u."
    )  # fmt: skip


@pytest.mark.parametrize("writer", ["python2", "protocol2", "protocol4", "protocol5"])
def test_genuine_cifar_batches_load_identically(tmp_path: Path, writer: str) -> None:
    data = RNG.integers(0, 256, size=(5, 3072), dtype=np.uint8)
    labels = [3, 0, 9, 9, 1]
    path = tmp_path / "data_batch_1"
    if writer == "python2":
        path.write_bytes(py2_cifar_batch(data, labels))
    else:
        batch = {b"batch_label": b"training batch 1 of 5", b"data": data, b"labels": labels}
        path.write_bytes(pickle.dumps(batch, protocol=int(writer[-1])))
    images, read_labels = read_cifar_batch(path, b"labels", classes=10)
    assert images.dtype == np.uint8 and images.shape == (5, 3, 32, 32)
    assert np.array_equal(images.reshape(5, 3072), data)
    assert read_labels.dtype == np.int64 and read_labels.tolist() == labels
    # the standard library reads the same object from the same bytes
    expected = pickle.loads(path.read_bytes(), encoding="bytes")
    assert np.array_equal(expected[b"data"], data) and expected[b"labels"] == labels


def test_genuine_cifar100_loads_through_the_registry(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 6), ("test", 2)):
        batch = {
            b"data": RNG.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            b"fine_labels": [99, 0, 50, 1, 2, 3][:n],
            b"coarse_labels": [19, 0, 5, 1, 2, 3][:n],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    assert load_dataset("cifar100", tmp_path).y_train.tolist() == [99, 0, 50, 1, 2, 3]
    coarse = load_dataset("cifar100(labels=coarse)", tmp_path)
    assert coarse.num_classes == 20 and coarse.y_test.tolist() == [19, 0]


# --------------------------------------------------------------------------- npz


def test_npz_object_array_is_never_unpickled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    x = np.empty((2, 1), dtype=object)
    x[0, 0], x[1, 0] = System(f"touch '{marker}'"), Exec(f"open({str(marker)!r}, 'w')")
    np.savez(tmp_path / "d.npz", x=x, y=np.array([0, 1]))
    refused(["data", "show", "npz(path=d.npz)", "--load", "--data-dir", str(tmp_path)],
            r"'x' cannot be read: Object arrays cannot be loaded", capsys)  # fmt: skip
    assert not marker.exists()


# --------------------------------------------------------------------------- checkpoints

SMALL = dict(
    dataset="digits",
    model="fc(depth=1,params=800)",
    batch_size=32,
    lr=0.1,
    max_iterations=6,
    checkpoint_every=3,
    snapshot_every_epochs=0.05,
    dtype="float64",
)


def params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine checkpoint (with weight snapshots, numpy arrays in the trainer)."""
    path = tmp_path_factory.mktemp("ckpt") / "run.ckpt"
    Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=path).run()
    return path


def torch_saved(value: object) -> Callable[[Path], bytes]:
    def make(path: Path) -> bytes:
        torch.save(value, path)
        return path.read_bytes()

    return make


def hostile_checkpoints(marker: Path, genuine: bytes) -> dict[str, bytes | Callable]:
    return {
        "torch.save(os.system)": torch_saved(
            {"config_hash": "x", "x": System(f"touch '{marker}'")}
        ),
        "torch.save(exec)": torch_saved(Exec(f"open({str(marker)!r}, 'w').close()")),
        "pickle(os.system)": pickle.dumps(System(f"touch '{marker}'")),
        "pickle(exec)": pickle.dumps(Exec(f"open({str(marker)!r}, 'w').close()"), protocol=2),
        "pickle(dict)": pickle.dumps({"config_hash": "x", "rng": {}}),
        "truncated": genuine[: len(genuine) // 2],
        "truncated-early": genuine[:100],
        "garbage": bytes(range(256)) * 8,
        "empty": b"",
        "text": b"config_hash = 'x'\n",
        "numpy-array": torch_saved({"config_hash": "x", "rng": {}, "w": np.zeros(3)}),
    }


HOSTILE = ["torch.save(os.system)", "torch.save(exec)", "pickle(os.system)", "pickle(exec)",
           "pickle(dict)", "truncated", "truncated-early", "garbage", "empty", "text",
           "numpy-array"]  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE)
def test_crafted_checkpoint_is_refused_without_running(
    tmp_path: Path, checkpoint: Path, name: str
) -> None:
    marker = tmp_path / "marker"
    made = hostile_checkpoints(marker, checkpoint.read_bytes())[name]
    path = tmp_path / "bad.ckpt"
    path.write_bytes(made(tmp_path / "scratch") if callable(made) else made)
    trainer = Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=path)
    before = params(trainer).clone()
    with pytest.raises(BatchboundError, match=r"bad\.ckpt is not a batchbound checkpoint \("):
        trainer.run(resume=True)
    assert not marker.exists()
    assert torch.equal(params(trainer), before)  # nothing of it was applied


@pytest.mark.parametrize("name", ["torch.save(os.system)", "pickle(exec)", "truncated", "empty"])
def test_crafted_checkpoint_through_the_cli(
    tmp_path: Path, checkpoint: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    made = hostile_checkpoints(marker, checkpoint.read_bytes())[name]
    path = tmp_path / "bad.ckpt"
    path.write_bytes(made(tmp_path / "scratch") if callable(made) else made)
    argv = ["train", "--dataset", "digits", "--model", SMALL["model"], "-B", "32", "--lr", "0.1",
            "--max-iterations", "6", "--checkpoint", str(path), "--resume",
            "--no-progress"]  # fmt: skip
    refused(argv, r"bad\.ckpt is not a batchbound checkpoint", capsys)
    assert not marker.exists()


def test_checkpoint_of_another_config_is_refused_before_anything_applies(
    tmp_path: Path, checkpoint: Path
) -> None:
    trainer = Trainer(
        TrainConfig(**{**SMALL, "lr": 0.3}), DistContext(), checkpoint_path=checkpoint
    )
    before = params(trainer).clone()
    with pytest.raises(BatchboundError, match="resume with the same configuration"):
        trainer.run(resume=True)
    assert torch.equal(params(trainer), before)


@pytest.mark.parametrize(
    "content",
    [
        {"model": {"nonsense": torch.zeros(2)}},
        {"model": "a string"},
        {"generators": [torch.zeros(3)], "state": {"iteration": 1}},
        {},
    ],
    ids=["wrong-model-keys", "model-not-a-dict", "missing-state", "only-hash-and-rng"],
)
def test_checkpoint_with_this_hash_but_wrong_content(
    tmp_path: Path, checkpoint: Path, content: dict
) -> None:
    """A file that reads safely and names this config, but not one the trainer wrote."""
    genuine = load_checkpoint(checkpoint)
    path = tmp_path / "forged.ckpt"
    torch.save({**genuine, **content} if content else
               {"config_hash": genuine["config_hash"], "rng": genuine["rng"]}, path)  # fmt: skip
    trainer = Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=path)
    with pytest.raises(BatchboundError, match=r"forged\.ckpt does not fit this run"):
        trainer.run(resume=True)


@pytest.mark.parametrize("name, value", [("iteration", "abc"), ("train_seconds", [1.0]),
                                         ("curves", 5), ("status", None), ("iteration", -5),
                                         ("last_eval_iteration", -2),
                                         ("train_seconds", float("nan"))])
def test_checkpoint_whose_run_state_has_the_wrong_kinds(
    tmp_path: Path, checkpoint: Path, name: str, value: object
) -> None:
    """An edited run state: ``iteration = "abc"`` failed mid-run with a TypeError, exit 1
    (an outside review); refused before anything runs now."""
    genuine = load_checkpoint(checkpoint)
    path = tmp_path / "forged.ckpt"
    torch.save({**genuine, "state": {**genuine["state"], name: value}}, path)
    trainer = Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=path)
    with pytest.raises(BatchboundError, match=rf"forged\.ckpt does not fit this run \(its "
                                              rf"{name} is .*, where a run's is ") as info:
        trainer.run(resume=True)
    assert "BatchboundError" not in str(info.value)  # said once, not wrapped in itself


def test_checkpoint_with_weights_that_are_not_finite(tmp_path: Path, checkpoint: Path) -> None:
    """An edited or damaged file's nan weights were loaded and trained on (nans only)."""
    genuine = load_checkpoint(checkpoint)
    model = dict(genuine["model"])
    name = next(k for k, v in model.items() if v.is_floating_point())
    model[name] = torch.full_like(model[name], float("nan"))
    path = tmp_path / "forged.ckpt"
    torch.save({**genuine, "model": model}, path)
    trainer = Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=path)
    with pytest.raises(BatchboundError, match=rf"forged\.ckpt holds weights that are not "
                                              rf"finite \(nan or inf in {re.escape(name)}\)"):
        trainer.run(resume=True)
    # the genuine one still resumes (a fresh run's nan learning rate stays allowed)
    Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=checkpoint).load_checkpoint()


def test_a_frozen_parameter_may_hold_minus_infinity() -> None:
    """A causal mask kept as a frozen parameter holds -inf by design: a resume of it was
    refused (an outside review); a trained parameter's nan still is."""
    from batchbound.train.loop import _check_finite_weights

    model = torch.nn.Linear(2, 2)
    model.mask = torch.nn.Parameter(torch.full((2, 2), -math.inf), requires_grad=False)
    _check_finite_weights(model, "ck.pt")
    with torch.no_grad():
        model.bias[0] = math.nan
    with pytest.raises(BatchboundError, match=r"nan or inf in bias\)"):
        _check_finite_weights(model, "ck.pt")


def test_checkpoints_hold_only_tensors_and_plain_data(checkpoint: Path) -> None:
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)  # raises otherwise
    snapshots = saved["state"]["snapshots"]
    assert snapshots and all(isinstance(w, torch.Tensor) for _, _, w in snapshots)
    assert isinstance(saved["rng"]["numpy"][1], torch.Tensor)
    # and they come back as numpy arrays in the trainer
    trainer = Trainer(TrainConfig(**SMALL), DistContext(), checkpoint_path=checkpoint)
    trainer.load_checkpoint()
    assert all(isinstance(w, np.ndarray) and w.dtype == np.float32 for *_, w in trainer.snapshots)


def test_storable_converts_numpy_and_keeps_state_dicts() -> None:
    model = torch.nn.Linear(2, 1)
    state = model.state_dict()
    value = {"model": state, "s": [(1, np.float64(0.5), np.arange(3, dtype=np.float32))],
             "n": np.int64(3), "t": (np.bool_(True), "x", None)}  # fmt: skip
    out = storable(value)
    assert out["model"] is state and isinstance(state, OrderedDict)  # metadata kept
    ((_, e, w),) = out["s"]
    assert type(e) is float and e == 0.5 and torch.equal(w, torch.arange(3.0))
    assert out["n"] == 3 and type(out["n"]) is int and out["t"] == (True, "x", None)
    assert value["n"] == np.int64(3)  # the input is left alone
