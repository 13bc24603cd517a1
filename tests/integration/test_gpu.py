"""The CUDA paths: measure, train, advise on a GPU, and NCCL across ranks (``make test-gpu``;
each test skips, saying why, where there is no GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from batchbound.cli import main
from batchbound.data import load_dataset
from batchbound.diversity import measure
from batchbound.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]
MODEL = "fc(depth=2,params=4000)"


def test_measure_on_cuda_matches_the_cpu_in_float64():
    digits = load_dataset("digits")
    cpu = build_model(MODEL, digits.input_shape, digits.num_outputs, seed=0)
    gpu = build_model(MODEL, digits.input_shape, digits.num_outputs, seed=0).cuda()
    a = measure(cpu, digits, dtype=torch.float64)
    b = measure(gpu, digits, dtype=torch.float64)
    for got, want in ((b.S, a.S), (b.T, a.T)):
        assert got == pytest.approx(want, rel=1e-9)


def test_cli_measure_and_train_on_cuda(capsys: pytest.CaptureFixture[str]):
    assert main(["measure", "--dataset", "digits", "--model", MODEL, "--device", "cuda",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"].startswith("cuda")
    assert main(["train", "--dataset", "digits", "--model", MODEL, "-B", "64", "--lr", "0.1",
                 "--max-epochs", "2", "--device", "cuda", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "complete"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 GPUs")
def test_train_two_ranks_over_nccl(capsys: pytest.CaptureFixture[str]):
    assert main(["train", "--dataset", "digits", "--model", MODEL, "-B", "64", "--lr", "0.1",
                 "--max-epochs", "2", "--device", "cuda", "--workers", "2", "--json",
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "complete"


def test_advise_pilots_and_times_on_cuda(capsys: pytest.CaptureFixture[str]):
    assert main(["advise", "--dataset", "mnist5k", "--model", "fc(depth=2,params=20000)",
                 "--lr", "0.1", "-B", "16", "--planned-epochs", "2", "--max-workers", "1",
                 "--device", "cuda", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    pilot = advice["pilot"]  # the pilot is its fraction of the plan, as on the CPU
    assert pilot["iterations"] == round(pilot["fraction"] * pilot["planned_iterations"])
    seconds = [r["seconds_per_iteration"] for r in advice["rows"]]
    if advice["timing_reliable"]:
        assert all(s > 0 for s in seconds)
    else:  # a step of ~0.1 ms on a GPU may not settle: the answer on iterations, saying why
        assert advice["timing_warning"] and all(s is None for s in seconds), advice


def test_watch_around_a_bf16_autocast_step_of_gpt2_at_context_1024():
    """watch() around the step almost every GPU user trains in: a GPT-2-size model (HF GPT-2
    small, 124M parameters) at context 1024 under torch.autocast("cuda", bfloat16). A number,
    S within 2 % of the float64 per-example loop, the precision stated (issue 35)."""
    import copy
    import warnings

    import torch.nn.functional as F
    from training_models import loop_S_T

    from batchbound.diversity import OnlineDiversity, watch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=1024, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).cuda()
    n, vocab = 4, config.vocab_size
    x = torch.randint(0, vocab, (n, 1024), device="cuda")
    y = torch.randint(0, vocab, (n, 1024), device="cuda")

    def loss(out, targets):
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum")

    exact = copy.deepcopy(model).double()
    S, _ = loop_S_T(exact, (x,), {}, lambda out, i: loss(out, y[i : i + 1]), n)
    del exact
    monitor = OnlineDiversity(10_000, decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor, reduction="sum"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss(out, y).backward()
    messages = [str(w.message) for w in caught if "batchbound" in str(w.message)]
    assert any("computes in bfloat16" in m for m in messages), messages
    assert not any("exact per-example gradients by" in m for m in messages), messages  # rules
    assert monitor.m2 * n == pytest.approx(S, rel=0.02)
    assert monitor.precision.startswith("bfloat16 (autocast")


def test_watch_and_the_callbacks_bookkeeping_steps_do_not_sync_the_device():
    """No host synchronisation in a watch() step (float32 and bfloat16 autocast, an embedding
    too large to materialise) nor in the callbacks' per-step bookkeeping:
    torch.cuda.set_sync_debug_mode("error") raises on any, torch's own included. The read
    (monitor.batch_bound, StepRecords.fold) is the one sync (tests/unit/test_host_syncs.py is
    the CPU proxy)."""
    import torch.nn.functional as F
    from host_syncs import tiny_model

    from batchbound.diversity import OnlineDiversity, watch
    from batchbound.integrations.common import MicroBatchNorms, StepRecords

    vocab = 20_000
    batches = [(torch.randint(0, vocab, (8, 6), device="cuda"),
                torch.randint(0, 11, (8, 6), device="cuda")) for _ in range(7)]
    for autocast in (False, True):
        model = tiny_model(vocab).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = OnlineDiversity(1000)

        def step(x, y, model=model, opt=opt, monitor=monitor, autocast=autocast):
            opt.zero_grad()
            with watch(model, monitor), torch.autocast("cuda", dtype=torch.bfloat16,
                                                      enabled=autocast):
                F.cross_entropy(model(x).transpose(1, 2).float(), y).backward()
            opt.step()

        # the first step checks the model (the probe, the loop), the 2nd and 4th the loss's
        # coupling again (then the 8th, …): one read each
        for x, y in batches[:4]:
            step(x, y)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, y in batches[4:]:
                step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert monitor.steps == 7 and monitor.batch_bound > 0

    model = tiny_model(vocab).cuda()
    norms, records = MicroBatchNorms(model.parameters()), StepRecords(OnlineDiversity(1000))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(2):
            model.zero_grad()
            for x, y in batches[3 * k: 3 * k + 3]:
                norms.start(8, 1.0)
                F.cross_entropy(model(x).transpose(1, 2), y).backward()
            records.add(norms.record(1.0 / 3, 1.0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert records.fold().steps == 2


def test_bfloat16_products_on_cuda_are_float32_sums_of_exact_products():
    """``forms.products`` multiplies bfloat16 operands on the tensor cores with float32
    results: within float32's rounding of the d-term sums (d·2⁻²⁴ of Σ|x||y|) of float64's."""
    from batchbound.diversity.rules.forms import products

    torch.manual_seed(0)
    x = torch.randn(4, 64, 3000, device="cuda").bfloat16()
    got = products(x, x.transpose(1, 2))
    assert got.dtype == torch.float32
    wide = x.double()
    err = (got.double() - wide @ wide.transpose(1, 2)).abs()
    assert bool((err <= 3000 * 2.0**-24 * (wide.abs() @ wide.abs().transpose(1, 2))).all())


def test_watch_of_a_bfloat16_gpt2_on_cuda_matches_its_widened_rules(monkeypatch):
    """The low-precision path (Linear and Conv1D given bfloat16 terms, multiplied on the
    tensor cores) against the rules given float32 terms, on the same GPU and batch."""
    import dataclasses

    from transformers import GPT2Config, GPT2LMHeadModel

    from batchbound.diversity import OnlineDiversity, watch
    from batchbound.diversity.rules import registry

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64,
                                       vocab_size=1000, use_cache=False, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).cuda().eval()
    x = torch.randint(1000, (8, 65), device="cuda")

    def sums() -> tuple[float, float]:  # one step's (M2, C)
        monitor = OnlineDiversity(1000)
        with watch(model, monitor), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
            torch.nn.functional.cross_entropy(logits.float().reshape(-1, 1000),
                                              x[:, 1:].reshape(-1)).backward()
        model.zero_grad(set_to_none=True)
        last = monitor.last
        assert last is not None
        return last

    low = sums()
    conv1d = "transformers.pytorch_utils.Conv1D"
    monkeypatch.setitem(registry.RULES, torch.nn.Linear, dataclasses.replace(
        registry.RULES[torch.nn.Linear], low_precision=False))
    monkeypatch.setitem(registry.NAMED_RULES, conv1d, dataclasses.replace(
        registry.NAMED_RULES[conv1d], low_precision=False))
    wide = sums()
    assert low == pytest.approx(wide, rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_measure_stays_within_its_memory_budget_on_cuda(precision: str):
    """The budget's search on CUDA's allocator peak (budget.peak_bytes): a LeNet-5 at 1024
    images (its bfloat16 run went 2.23 × over the earlier estimate's budget on an H100) and
    the whole run at the chosen chunk within it."""
    import torch.nn.functional as F
    from outside_models import lenet5

    from batchbound.diversity.budget import peak_bytes

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = lenet5().to(device).eval()
    x = torch.randn(1024, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (1024,), device=device)

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, reduction="none")

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            losses = loss(model(x), y)
        losses.mean().backward()

    plain()
    budget = int(1.5 * peak_bytes(device, plain))
    model.zero_grad(set_to_none=True)
    with autocast:
        chunk = measure(model, (x, y), loss, chunk_size=1024,
                        memory_budget=budget).extra["chunk_size"]

    def bounded() -> None:
        with autocast:
            measure(model, (x, y), loss, chunk_size=chunk)

    assert peak_bytes(device, bounded) <= budget
