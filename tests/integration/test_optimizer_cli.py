"""``batchbound train --optimizer adamw --betas 0.9,0.95`` on a text LM, and the Adam default
rate rule stated in ``advise --help``."""

from __future__ import annotations

import json

import pytest

from batchbound.cli import main

TEXT = ("A character model reads this line again and again. " * 5 + "\n\n") * 12


def test_train_adamw_on_a_text_lm(tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code = main(["train", "--dataset", f"text(path={text},context=16)", "--model",
                 "gpt(depth=1,width=16,heads=2)", "-B", "8", "--lr", "0.01", "--optimizer",
                 "adamw", "--betas", "0.9,0.95", "--weight-decay", "0.1", "--max-iterations",
                 "30", "--eval-every-iterations", "15", "--no-progress", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "complete" and out["final"]["iterations"] == 30
    # the hash is AdamW's with these betas, not SGD's
    from batchbound.train import TrainConfig
    config = TrainConfig(dataset=f"text(path={text},context=16)",
                         model="gpt(depth=1,width=16,heads=2)", batch_size=8, lr=0.01,
                         optimizer="adamw", betas=(0.9, 0.95), weight_decay=0.1,
                         max_iterations=30, eval_every_iterations=15)
    assert out["config_hash"] == config.config_hash()


@pytest.mark.parametrize(("flags", "words"), [
    (["--optimizer", "adamw", "--betas", "0.9"], "betas: expected a list of 2"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "momentum is SGD's"),
    (["--optimizer", "rmsprop"], "invalid choice"),
])
def test_bad_optimizer_flags_are_one_line(flags, words, capsys) -> None:
    assert main(["train", "--dataset", "digits", "--max-iterations", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_advise_help_states_the_adam_rule(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["advise", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--optimizer {sgd,adamw,adam}" in text
    assert "srsr: η0·√(B/B0)" in text
    assert "(srsr is the default for --optimizer adamw and adam)" in text
    assert "--critical-batch {branches,noise}" in text and "--budget F" in text
