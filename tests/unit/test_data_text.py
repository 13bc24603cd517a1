"""Text data sets: the fixed vocabulary, windows and next-token targets, whole documents held
out, one-line errors, the transforms on text, and Debian's fortunes (skipped, naming the
package, where it is not installed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import batchbound.data.text as text_module
from batchbound.data import TEXT, apply_transform, get_entry, load_dataset, neighbour_pair
from batchbound.data.text import (
    DEBIAN_FORTUNES,
    DEFAULT_FILES,
    VOCAB_SIZE,
    VOCABULARY,
    clean,
    decode,
    encode,
    windows,
)
from batchbound.errors import BatchboundError

PARAGRAPHS = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(20)]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(PARAGRAPHS), encoding="utf-8")
    return path


def test_vocabulary_is_fixed_and_round_trips() -> None:
    assert VOCAB_SIZE == 98 == len(set(VOCABULARY))
    text = "Tab\there, newline\n and ~ printable!"
    ids = encode(text)
    assert ids.dtype == np.int64 and ids.min() > 0 and ids.max() < VOCAB_SIZE
    assert decode(ids) == text
    assert encode("é€\x07").tolist() == [0, 0, 0]  # outside the vocabulary: unknown
    assert clean("_\bWo\r\nb\bbo\bol\bld\bd") == "Wo\nbold"  # overstrikes, CRLF


def test_windows_are_inputs_and_next_tokens() -> None:
    ids = np.arange(1, 12, dtype=np.int64)  # 11 tokens, context 3: (11 - 1) // 3 = 3 windows
    x, y = windows(ids, 3)
    assert x.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert y.tolist() == [[2, 3, 4], [5, 6, 7], [8, 9, 10]]


def test_text_file_split_holds_out_whole_paragraphs(corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=16)")
    assert ds.task == TEXT and ds.num_classes == ds.num_outputs == VOCAB_SIZE
    assert ds.input_shape == (16,) and ds.x_train.dtype == ds.y_train.dtype == torch.int64
    assert torch.equal(ds.x_train[:, 1:], ds.y_train[:, :-1])  # targets: shifted by one
    assert torch.equal(ds.x_train[1:, 0], ds.y_train[:-1, -1])  # windows are contiguous
    assert ds.meta["documents"] == [18, 2]
    train, test = decode(ds.x_train.flatten()), decode(ds.x_test.flatten())
    assert "Paragraph 9:" in test and "Paragraph 19:" in test
    assert "Paragraph 9:" not in train and "Paragraph 19:" not in train
    assert "Paragraph 8:" in train
    described = ds.describe()
    assert described["task"] == "text" and described["classes"] == 98


def test_text_options_and_errors(corpus: Path, tmp_path: Path) -> None:
    no_test = load_dataset(f"text(path={corpus},context=8,test_every=0)")
    assert no_test.n_test == 0 and no_test.meta["documents"] == [20, 0]
    with pytest.raises(BatchboundError, match=r"fewer than context \+ 1 = 5001"):
        load_dataset(f"text(path={corpus},context=5000)")
    with pytest.raises(BatchboundError, match="context must be an integer >= 1, got 0"):
        load_dataset(f"text(path={corpus},context=0)")
    with pytest.raises(BatchboundError, match="test_every=1 would hold out every document"):
        load_dataset(f"text(path={corpus},test_every=1)")
    with pytest.raises(BatchboundError, match="needs path=FILE"):
        load_dataset("text")
    with pytest.raises(BatchboundError, match="not found"):
        load_dataset(f"text(path={tmp_path / 'nope.txt'})")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(BatchboundError, match="is not UTF-8 text"):
        load_dataset(f"text(path={latin1})")


def test_to_keeps_token_ids_integer(corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=16)").to("cpu", torch.float64)
    assert ds.x_train.dtype == ds.y_train.dtype == ds.x_test.dtype == torch.int64


def test_transforms_work_on_sequences(corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=8)")
    half = apply_transform(ds, "subset(fraction=0.5)", seed=0)
    assert half.n_train == round(ds.n_train / 2) and half.input_shape == (8,)
    rows = {tuple(r) for r in ds.x_train.tolist()}
    assert all(tuple(r) in rows for r in half.x_train.tolist())
    twice = apply_transform(ds, "replicate_full(r=2)", seed=0)
    assert torch.equal(twice.y_train[ds.n_train:], ds.y_train)
    first, second = neighbour_pair(ds, seed=1)
    differ = (first.x_train != second.x_train).any(dim=1)
    assert int(differ.sum()) <= 1 and first.n_test == ds.n_test - 1


def test_registry_describes_both_sets() -> None:
    fortunes, text = get_entry("fortunes"), get_entry("text")
    assert fortunes.task == text.task == "text" and fortunes.classes == text.classes == 98
    assert fortunes.input_shape == (64,) and not fortunes.embedded
    assert "1389/147 sequences" in fortunes.description


def test_fortunes_missing_names_the_debian_package(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(text_module, "DEBIAN_FORTUNES", tmp_path / "nowhere")
    reason = get_entry("fortunes").missing(tmp_path)
    assert reason is not None and "sudo apt-get install fortunes" in reason
    with pytest.raises(BatchboundError, match="apt-get install fortunes"):
        load_dataset("fortunes", tmp_path)
    # a user's own copy in DIR/fortunes/ is found first
    (tmp_path / "fortunes").mkdir()
    for name in DEFAULT_FILES:
        (tmp_path / "fortunes" / name).write_text("".join(f"{p}%\n" for p in PARAGRAPHS))
    assert get_entry("fortunes").missing(tmp_path) is None
    ds = load_dataset("fortunes(context=16)", tmp_path)
    assert ds.meta["documents"] == [54, 6] and "Paragraph 9:" in decode(ds.x_test.flatten())


def test_fortunes_options_are_checked() -> None:
    with pytest.raises(BatchboundError, match=r"unknown file.*'wisdoms'"):
        load_dataset("fortunes(files=[wisdoms])")
    with pytest.raises(BatchboundError, match="listed twice"):
        load_dataset("fortunes(files=[tao,tao])")
    with pytest.raises(BatchboundError, match="option context must be int"):
        load_dataset("fortunes(context=3.5)")


needs_fortunes = pytest.mark.skipif(
    not all((DEBIAN_FORTUNES / name).is_file() for name in DEFAULT_FILES),
    reason="Debian's fortunes not installed: sudo apt-get install fortunes "
    "(Debian package fortunes)",
)


@needs_fortunes
def test_real_fortunes_match_the_registry_facts(tmp_path: Path) -> None:
    ds = load_dataset("fortunes", tmp_path)  # empty data dir: falls back to Debian's copy
    entry = get_entry("fortunes")
    assert (ds.n_train, ds.n_test) == (entry.n_train, entry.n_test)
    assert ds.input_shape == entry.input_shape and ds.num_classes == entry.classes
    assert entry.missing(tmp_path) is None
    train, test = decode(ds.x_train.flatten()), decode(ds.x_test.flatten())
    assert train.count("%\n") > 500 and " the " in train and " the " in test
    # whole fortunes are held out: no test fortune of some length appears in the train text
    fortunes = [f for f in test.split("%\n")[1:-1] if len(f) > 60]
    assert fortunes and not any(f in train for f in fortunes)
    assert ds.meta["unknown_characters"] < 10
    riddles = load_dataset("fortunes(files=riddles,context=32,test_every=5)", tmp_path)
    train_docs, test_docs = riddles.meta["documents"]
    assert riddles.input_shape == (32,) and test_docs == (train_docs + test_docs) // 5
