"""`advise --figure` with a suffix matplotlib draws no format for (``fig.txt``, a version
``fig.v1.2``): refused before any work in one line, exit 2; it was a ValueError traceback
after the whole advice. No suffix, or one in any case (``.PNG``), is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchbound.cli import main
from batchbound.cli.advise import figure_format

COMMAND = ["advise", "--dataset", "digits", "--model", "fc(depth=2,params=4000)", "--lr", "0.1",
           "--target-train-acc", "0.95"]


@pytest.mark.parametrize("name", ["fig.txt", "fig.v1.2"])
def test_a_figure_in_a_format_matplotlib_cannot_draw_is_refused_up_front(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str) -> None:
    code = main([*COMMAND, "--figure", str(tmp_path / name)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) <= 2, err
    assert err[-1].startswith("batchbound advise: error") and "png" in err[-1], err
    assert not any(line.startswith("advise:") for line in err)  # no work began
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["fig", "fig.png", "fig.PNG", "fig.svg", "fig.pdf"])
def test_the_formats_it_draws_pass(tmp_path: Path, name: str) -> None:
    assert figure_format(str(tmp_path / name)) == tmp_path / name
