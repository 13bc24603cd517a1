"""The optimisers: sgd unchanged (results and stored hashes), adamw and adam against
torch's own update, settings refused where they would be ignored, and an AdamW text LM that
resumes bit-identically from its checkpoint."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer
from batchbound.train.optimizers import OPTIMIZERS

TEXT = ("The quick brown fox jumps over the lazy dog. " * 6 + "\n\n") * 12


def lm_config(path: str, **changes: object) -> TrainConfig:
    return TrainConfig(**{
        "dataset": f"text(path={path},context=16,test_every=0)",
        "model": "gpt(depth=1,width=16,heads=2)", "batch_size": 8, "lr": 0.01,
        "optimizer": "adamw", "betas": (0.9, 0.95), "weight_decay": 0.1,
        "max_iterations": 24, "max_epochs": None, "eval_every_iterations": 8,
        "dtype": "float64", **changes})


def params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def test_registry_and_defaults() -> None:
    assert set(OPTIMIZERS) >= {"sgd", "adamw", "adam"}
    config = TrainConfig()
    assert config.optimizer == "sgd" and config.betas == (0.9, 0.999) and config.eps == 1e-8
    # stored runs keep their keys: the new fields are hashed only when set
    assert config.config_hash() == "956d8208960ae2e5"
    assert TrainConfig(optimizer="sgd").config_hash() == config.config_hash()
    adamw = TrainConfig(optimizer="adamw")
    assert adamw.config_hash() != config.config_hash()
    assert adamw.replace(betas=(0.9, 0.95)).config_hash() != adamw.config_hash()
    assert TrainConfig.from_dict(adamw.replace(betas="0.9,0.95").to_dict()).betas == (0.9, 0.95)


@pytest.mark.parametrize(("changes", "words"), [
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"optimizer": "adamw", "momentum": 0.9}, "momentum is SGD's"),
    ({"betas": (0.9, 0.95)}, "betas and eps are Adam's"),
    ({"eps": 1e-6}, "betas and eps are Adam's"),
    ({"optimizer": "adam", "betas": (0.9, 1.0)}, "betas must each be in [0, 1)"),
    ({"optimizer": "adam", "betas": "0.9;0.95"}, "betas is two numbers"),
    ({"optimizer": "adam", "betas": (0.9,)}, "betas: expected a list of 2"),
    ({"optimizer": "adam", "eps": 0.0}, "eps must be > 0"),
    ({"optimizer": "adamw", "final_probes": ("linear_error",)}, "measures SGD's step"),
])
def test_bad_optimizer_settings_are_refused(changes: dict, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        TrainConfig(**changes)
    assert words in str(info.value)


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_the_trainer_steps_as_torch_does(name: str) -> None:
    """Our trainer's parameters after 5 steps equal a plain loop's with torch's optimiser
    over the same batches (the mean convention, float64)."""
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=32,
                         lr=0.01, optimizer=name, betas=(0.8, 0.9), eps=1e-7,
                         weight_decay=0.05, max_iterations=5, eval_every_iterations=5,
                         dtype="float64")
    trainer = Trainer(config, DistContext())
    model = __import__("copy").deepcopy(trainer.model)
    indices = []
    step = trainer.sampler.next_indices

    def record(batch: int) -> torch.Tensor:
        out = step(batch)
        indices.append(out.clone())
        return out

    trainer.sampler.next_indices = record  # type: ignore[method-assign]
    trainer.run()
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    reference = cls(model.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    for local in indices:
        x, y = trainer.data.x_train[local], trainer.data.y_train[local]
        reference.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        reference.step()
    mine = params(trainer)
    theirs = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
    assert not torch.equal(mine, params(Trainer(config, DistContext())))  # it trained


def test_adamw_text_lm_resumes_bit_identically(tmp_path) -> None:
    text = tmp_path / "fox.txt"
    text.write_text(TEXT)
    config = lm_config(str(text), checkpoint_every=5)
    whole = Trainer(config, DistContext())
    expected = whole.run()
    path = tmp_path / "run.ckpt"
    first = Trainer(config, DistContext(), checkpoint_path=path)
    step = first.train_step

    def interrupted(*args: object) -> dict:
        if first.iteration == 10:  # SIGTERM arrives during iteration 11
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    first.train_step = interrupted  # type: ignore[method-assign]
    assert first.run().status == "stopped"
    again = Trainer(config, DistContext(), checkpoint_path=path)
    resumed = again.run(resume=True)
    assert resumed.status == "complete" and resumed.final["iterations"] == 24
    strip = [(i, e, m, v) for i, e, _, m, v in expected.curves]
    assert [(i, e, m, v) for i, e, _, m, v in resumed.curves] == strip
    assert torch.equal(params(again), params(whole))
    mine, theirs = again.optimizer.state_dict(), whole.optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for a, b in zip(mine["state"].values(), theirs["state"].values(), strict=True):
        assert set(a) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the losses fell: an AdamW text LM trains
    losses = [v for _, _, _, m, v in expected.curves if m == "train_loss"]
    assert losses[-1] < losses[0]


def test_a_checkpointed_run_on_data_without_a_test_split(tmp_path) -> None:
    """The checkpoint's data digest reads every split, an empty one too (test_fraction=0)."""
    from batchbound.data.dataset import Dataset
    from batchbound.data.identity import data_digest

    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    empty = Dataset(name="tiny", task="classification", x_train=x, y_train=y,
                    x_test=x[:0], y_test=y[:0], num_classes=2, source="test")
    assert data_digest(empty).startswith("sha256:")


def test_adams_preconditioner_is_one_over_root_v_hat_plus_eps() -> None:
    from batchbound.train.optimizers import adam_preconditioner

    torch.manual_seed(0)
    params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-6)
    assert adam_preconditioner(opt, params) is None  # before its first step: no v
    grads = []
    for _ in range(3):
        opt.zero_grad()
        loss = sum((p.double() ** 3).sum() for p in params)
        loss.backward()
        grads.append([p.grad.clone() for p in params])
        opt.step()
    weights = adam_preconditioner(opt, params)
    for i, w in enumerate(weights):
        v = sum(0.95 ** (2 - k) * 0.05 * grads[k][i] ** 2 for k in range(3))  # float reference
        expected = 1.0 / ((v / (1 - 0.95**3)).sqrt() + 1e-6)
        torch.testing.assert_close(w, expected, rtol=1e-5, atol=0)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sgd.zero_grad()
    sum(p.sum() for p in params).backward()
    sgd.step()
    assert adam_preconditioner(sgd, params) is None  # no second moment: not Adam's kind


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adams_preconditioner_is_the_metric_of_the_step_it_took(kind: str, amsgrad: bool
                                                                ) -> None:
    """By construction rather than by formula: the last step moved each coordinate by
    lr·m̂·P. With amsgrad the step divides by the running maximum of v, not by v, so a
    preconditioner read off v would be another metric than the one the steps take."""
    from batchbound.train.optimizers import adam_preconditioner

    torch.manual_seed(0)
    params = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]
    opt = getattr(torch.optim, kind)(params, lr=0.01, betas=(0.9, 0.95), eps=1e-6,
                                     weight_decay=0.0, amsgrad=amsgrad, foreach=False)
    for scale in (10.0, 3.0, 1.0, 0.3):  # shrinking gradients: max(v) stays above v
        before = params[0].detach().clone()
        params[0].grad = scale * torch.randn(3, 4, dtype=torch.float64)
        opt.step()
    state, steps = opt.state[params[0]], 4
    m_hat = state["exp_avg"] / (1 - 0.9**steps)
    taken = before - params[0].detach()
    (weights,) = adam_preconditioner(opt, params)
    torch.testing.assert_close(taken, 0.01 * m_hat * weights, rtol=1e-10, atol=0)


@pytest.mark.parametrize("momentum", [0.5, 0.9, 0.99])
def test_heavy_balls_lag_is_mu_over_one_minus_mu(momentum: float) -> None:
    from batchbound.train.optimizers import step_lag

    lag = step_lag(lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum))
    assert lag == pytest.approx(momentum / (1 - momentum), rel=1e-4)


def test_step_lag_of_nesterov_plain_sgd_and_adam() -> None:
    from batchbound.train import TrainConfig
    from batchbound.train.optimizers import build_optimizer, step_lag

    # Nesterov steps g + μ·buf: Σ_s μ^(s+1) = μ²/(1 − μ) behind its steady step
    nesterov = step_lag(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))
    assert nesterov == pytest.approx(0.81 / 0.1, rel=1e-4)
    for config in (TrainConfig(dataset="digits", model="fc", lr=0.1),
                   TrainConfig(dataset="digits", model="fc", lr=0.003, optimizer="adamw",
                               weight_decay=0.1),
                   TrainConfig(dataset="digits", model="fc", lr=0.003, optimizer="adam")):
        # plain SGD moves its steady step at once; Adam's bias correction does the same
        assert step_lag(lambda p, c=config: build_optimizer(p, c)) == pytest.approx(0, abs=1e-6)


def _lag_stepped_to_the_end(make, tolerance: float = 1e-9, max_steps: int = 100_000) -> float:
    """The reference: step_lag as it was, every step until the step settles or max_steps,
    no early exit (Adagrad takes all 100 000)."""
    param = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = make([param])
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    steps: list[float] = []
    with torch.no_grad():
        for _ in range(max_steps):
            before = float(param)
            param.grad = torch.ones_like(param)
            optimizer.step()
            steps.append(before - float(param))
            if len(steps) > 1 and abs(steps[-1] - steps[-2]) <= tolerance * abs(steps[-1]):
                break
    steady = steps[-1]
    if not (math.isfinite(steady) and steady > 0):
        return 0.0
    lag = sum(1.0 - step / steady for step in steps)
    return lag if lag > 1e-6 else 0.0


LAG_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "heavy ball": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-3),  # dips, then climbs: lag 3.3
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "rmsprop momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("name", [n if n != "adagrad" else pytest.param(
    n, marks=pytest.mark.slow) for n in LAG_OPTIMIZERS])
def test_step_lag_equals_stepping_to_the_end(name: str) -> None:
    from batchbound.train.optimizers import step_lag

    make = LAG_OPTIMIZERS[name]
    assert step_lag(make) == _lag_stepped_to_the_end(make)


def test_adagrads_lag_takes_a_few_steps_not_100_000() -> None:
    from batchbound.train.optimizers import step_lag

    taken = []

    def make(params):
        optimizer = torch.optim.Adagrad(params, lr=1e-2)
        optimizer.register_step_post_hook(lambda *_: taken.append(1))
        return optimizer

    assert step_lag(make) == 0.0
    assert len(taken) <= 5  # η/√t: at half of the first step by the fourth
