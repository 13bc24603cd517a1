"""The in-loop tools' cost on a GPU (not a test; prints markdown tables or JSON): per model, a
plain forward+backward, ``measure()`` on the same batch, ``watch`` (and its cheap mode
``subset="norms"``) around the same step, ``watch`` on one step in ten (the rest plain, per
step: docs/diversity.md's pattern for a host-bound step), in float32 and under bf16
autocast, with peak memory; then the Lightning and Hugging Face ``DiversityCallback``s per
optimizer step.

Timing: CUDA-synchronised wall clock, the contenders interleaved, median of ``--repeats``
rounds after a warm-up (which also runs the one-off model check of ``watch``/``measure``).
Peak memory: ``torch.cuda.max_memory_allocated`` above what was allocated before the step.
``measure()`` runs twice: with the batch as one chunk (time), and with
``memory_budget`` = 1.5 × the plain step's peak (its peak against that budget).

    python benchmarks/gpu.py                        # the issue's table, on cuda
    python benchmarks/gpu.py --cases gpt2-small --json
    python benchmarks/gpu.py --device cpu --smoke   # a tiny run of every path, any machine
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.diversity.subsets import norm_layer_modules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import EVERY, one_in

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import GPT, HFLogits, classification_loss, images, lenet5, mlp, small_resnet


def token_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Each sequence's mean next-token cross-entropy, the vocabulary as the last dimension as
    Hugging Face and nanoGPT compute it. (Over dimension 1 of (n, V, T), ``logits.transpose(1,
    2)``, CUDA runs a spatial softmax kernel that took 86 of GPT-2 small's 117 ms bf16 step on
    an H100: a plain step that slow hid the tools' cost.)"""
    n, steps, vocab = logits.shape
    flat = F.cross_entropy(logits.float().reshape(n * steps, vocab), y.reshape(-1),
                           reduction="none")
    return flat.view(n, steps).mean(dim=1)


def tokens(context: int, vocab: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    def make(n: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(vocab, (n, context + 1), generator=g)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    return make


def hf_gpt2(layers: int, width: int, heads: int, context: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        return HFLogits(GPT2LMHeadModel(GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=context, vocab_size=50257,
            use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))

    return build


def hf_llama(layers: int, width: int, heads: int, context: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        return HFLogits(LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3,
            num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=context, vocab_size=32000, use_cache=False)))

    return build


@dataclass
class GpuCase:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Tensor, Tensor]]
    batch: int
    loss: Callable[[Tensor, Tensor], Tensor] = classification_loss


CASES = {
    "mlp": GpuCase("MLP 784-512³-10", mlp, images(1, 28, 28), 4096),
    "lenet": GpuCase("LeNet-5", lenet5, images(1, 28, 28), 1024),
    "resnet": GpuCase("ResNet-8, BatchNorm in eval", small_resnet, images(3, 32, 32), 256),
    "nanogpt": GpuCase("nanoGPT-style 4×128, context 64", GPT, tokens(64, 256), 64, token_loss),
    "gpt2-small": GpuCase("HF GPT-2 small 12×768, context 256", hf_gpt2(12, 768, 12, 256),
                          tokens(256, 50257), 16, token_loss),
    "llama": GpuCase("HF Llama 8×512, context 256", hf_llama(8, 512, 8, 256),
                     tokens(256, 32000), 16, token_loss),
    "gpt2-medium": GpuCase("HF GPT-2 medium, context 1024", hf_gpt2(24, 1024, 16, 1024),
                           tokens(1024, 50257), 8, token_loss),
}
# --smoke: every path on tiny shapes (CPU-friendly)
SMOKE = {
    "mlp": GpuCase("MLP 784-512³-10", mlp, images(1, 28, 28), 8),
    "lenet": GpuCase("LeNet-5", lenet5, images(1, 28, 28), 8),
    "gpt2-tiny": GpuCase("HF GPT-2 2×64, context 32", hf_gpt2(2, 64, 2, 32), tokens(32, 50257),
                         4, token_loss),
}


# ------------------------------------------------------------------------------- clocks

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - start


def peak_of(step: Callable[[], object], device: torch.device) -> float | None:
    """Peak bytes allocated above the start while ``step`` runs (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


@dataclass
class ToolRow:
    case: str
    precision: str
    batch: int
    plain_ms: float
    measure_ratio: float | None
    watch_extra: float | None  # % over the plain step
    norms_extra: float | None  # watch(subset="norms"), % over the plain step
    every_extra: float | None = None  # watch on 1 step in EVERY, the rest plain, per step
    plain_peak_mib: float | None = None
    watch_peak_mib: float | None = None
    measure_budget_peak_ratio: float | None = None  # peak / plain peak, budget 1.5× plain
    errors: dict[str, str] = field(default_factory=dict)


def tool_row(case: GpuCase, device: torch.device, precision: str, repeats: int) -> ToolRow:
    torch.manual_seed(0)
    with torch.device(device):  # parameters made and initialised on the device: no CPU init
        model = case.build().to(device).eval()
    x, y = case.inputs(case.batch)
    x, y = x.to(device), y.to(device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    monitors = {"all": OnlineDiversity(), "norms": OnlineDiversity()}

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = case.loss(model(x), y).mean()
        loss.backward()

    def watched(subset: str) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            with watch(model, monitors[subset], subset=subset):
                with autocast:
                    loss = case.loss(model(x), y).mean()
                loss.backward()
            monitors[subset].fold()  # its one host sync, once per step here

        return step

    def measured() -> None:
        with autocast:
            measure(model, (x, y), case.loss, chunk_size=case.batch)

    contenders: dict[str, Callable[[], None]] = {"plain": plain, "watch": watched("all"),
                                                 "norms": watched("norms"), "measure": measured,
                                                 "every": one_in(EVERY, watched("all"), plain)}
    if not norm_layer_modules(model):  # no LayerNorm/RMSNorm: no cheap mode to time
        del contenders["norms"]
    errors: dict[str, str] = {}
    for name, step in list(contenders.items()):  # warm-up; a refusal is reported, not fatal
        try:
            for _ in range(4):  # watch checks the loss again on its 2nd and 4th steps
                step()
        except Exception as exc:  # the table says which tool failed and why
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            del contenders[name]
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, step in contenders.items():
            times[name].append(timed(step, device))
    med = {name: statistics.median(t) for name, t in times.items()}
    p = med["plain"]

    def extra(name: str, steps: int = 1) -> float | None:
        return 100.0 * (med[name] / steps - p) / p if name in med else None

    row = ToolRow(case.name, precision, case.batch, 1000 * p,
                  med["measure"] / p if "measure" in med else None, extra("watch"),
                  extra("norms"), extra("every", EVERY), errors=errors)
    budget = None
    plain_peak = peak_of(plain, device)
    if plain_peak is not None:
        row.plain_peak_mib = plain_peak / 2**20
        budget = int(1.5 * plain_peak)
        if "watch" in contenders:
            row.watch_peak_mib = (peak_of(contenders["watch"], device) or 0.0) / 2**20

    def bounded() -> None:  # on CPU (no peak to read) it runs once, as a smoke test
        with autocast:
            measure(model, (x, y), case.loss, chunk_size=case.batch,
                    memory_budget=budget or 2**30)

    if "measure" in contenders:
        try:
            peak = peak_of(bounded, device) if plain_peak is not None else bounded()
            if peak is not None and plain_peak:
                row.measure_budget_peak_ratio = peak / plain_peak
        except Exception as exc:
            row.errors["measure(memory_budget)"] = str(exc).splitlines()[0][:160]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------- callbacks

@dataclass
class CallbackRow:
    framework: str
    model: str
    plain_s: float
    callback_s: float

    @property
    def extra(self) -> float:
        return 100.0 * (self.callback_s - self.plain_s) / self.plain_s


def callback_rows(device: torch.device, smoke: bool, runs: int,
                  on_row: Callable[[CallbackRow], None] = lambda row: None) -> list[CallbackRow]:
    layers, width, heads, context, batch, steps = ((2, 64, 2, 32, 2, 4) if smoke
                                                   else (6, 512, 8, 256, 8, 40))
    accumulation = 4
    bf16 = device.type == "cuda"
    name = f"HF GPT-2 {layers}×{width}, context {context}, {'bf16' if bf16 else 'fp32'}, " \
           f"accumulation {accumulation}"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(50257, (batch * accumulation * steps, context), generator=g)

    def model() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                          n_positions=context, use_cache=False))

    def lightning(with_callback: bool) -> float:
        import lightning.pytorch as L
        from torch.utils.data import DataLoader

        from batchbound.integrations.lightning import DiversityCallback

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model()

            def training_step(self, b: Tensor, batch_idx: int) -> Tensor:
                return self.net(input_ids=b, labels=b).loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-4)

        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(
                max_steps=steps, accumulate_grad_batches=accumulation,
                accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                precision="bf16-mixed" if bf16 else "32-true", logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp,
                callbacks=[DiversityCallback(every=10)] if with_callback else [])
            start = time.perf_counter()
            trainer.fit(Module(), DataLoader(ids, batch_size=batch))
            return (time.perf_counter() - start) / steps

    def hf(with_callback: bool) -> float:
        from transformers import Trainer, TrainingArguments

        from batchbound.integrations.transformers import DiversityCallback

        data = [{"input_ids": row, "labels": row} for row in ids]
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation, learning_rate=1e-4,
                report_to="none", save_strategy="no", logging_strategy="no", bf16=bf16,
                use_cpu=device.type != "cuda", dataloader_num_workers=0, disable_tqdm=True)
            trainer = Trainer(model=model(), args=args, train_dataset=data,
                              callbacks=[DiversityCallback(every=10)] if with_callback else [])
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.train()
            return (time.perf_counter() - start) / steps

    rows = []
    for framework, run in (("lightning", lightning), ("hf", hf)):
        best = {False: float("inf"), True: float("inf")}
        for _ in range(runs):  # min of the runs, the two alternating
            for with_callback in (False, True):
                best[with_callback] = min(best[with_callback], run(with_callback))
        rows.append(CallbackRow(framework, name, best[False], best[True]))
        on_row(rows[-1])
    return rows


# --------------------------------------------------------------------------------- main

def fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def print_tools_header(device: str) -> None:
    print(f"device {device}, torch {torch.__version__}")
    print("| model (batch) | precision | plain fwd+bwd | `measure()` ÷ plain | `watch` per step "
          f"| `watch(subset='norms')` | `watch` on 1 step in {EVERY}, per step | plain peak MiB "
          "| `watch` peak MiB | `measure` peak ÷ plain (budget 1.5×) | seconds |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


def print_tool_row(r: ToolRow, seconds: float) -> None:
    """One row, printed (and flushed) as soon as it is measured."""
    print(f"| {r.case} ({r.batch}) | {r.precision} | {r.plain_ms:.1f} ms "
          f"| {fmt(r.measure_ratio, '{:.2f}×')} | {fmt(r.watch_extra, '{:+.0f} %')} "
          f"| {fmt(r.norms_extra, '{:+.0f} %')} | {fmt(r.every_extra, '{:+.0f} %')} "
          f"| {fmt(r.plain_peak_mib, '{:.0f}')} "
          f"| {fmt(r.watch_peak_mib, '{:.0f}')} "
          f"| {fmt(r.measure_budget_peak_ratio, '{:.2f}')} | {seconds:.0f} |", flush=True)
    for tool, why in r.errors.items():
        print(f"|  ↳ {tool}: {why} |", flush=True)


def print_callback_row(c: CallbackRow) -> None:
    print(f"| {c.framework} | {c.model} | {c.plain_s:.4f} | {c.callback_s:.4f} "
          f"| {c.extra:+.1f} % |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--cases", default=None, help="comma-separated; default: all")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated fp32, bf16; default both on cuda, fp32 on cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--callback-runs", type=int, default=2)
    parser.add_argument("--no-callbacks", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu --smoke for a smoke test")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    cases = SMOKE if args.smoke else CASES
    keys = list(cases) if args.cases is None else [k.strip() for k in args.cases.split(",")]
    unknown = [k for k in keys if k not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(cases)}")
    repeats = 1 if args.smoke else args.repeats
    precisions = args.precisions or ("fp32,bf16" if device.type == "cuda" else "fp32")
    if not args.json:
        print_tools_header(torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu")
    tools = []
    for k in keys:
        for p in precisions.split(","):
            start = time.perf_counter()
            tools.append(tool_row(cases[k], device, p, repeats))
            if not args.json:
                print_tool_row(tools[-1], time.perf_counter() - start)
    callbacks: list[CallbackRow] = []
    if not args.no_callbacks:
        if not args.json:
            print("\n| callback | model | plain s/step | with callback s/step | extra |")
            print("|---|---|---|---|---|", flush=True)
        runs = 1 if args.smoke else args.callback_runs
        callbacks = (callback_rows(device, args.smoke, runs) if args.json
                     else callback_rows(device, args.smoke, runs, print_callback_row))
    if args.json:
        out: dict[str, Any] = {"device": str(device), "tools": [asdict(r) for r in tools],
                               "callbacks": [{**asdict(c), "extra": c.extra} for c in callbacks]}
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
