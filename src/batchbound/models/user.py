"""A user's own model, named ``MODULE:CALLABLE`` (the convention of ``uvicorn app:app``).

``mymodels:small_cnn`` imports ``mymodels`` from the current directory or PYTHONPATH and calls
``small_cnn`` with whichever of ``input_shape``, ``num_outputs`` and ``seed`` its signature
names (or with nothing). This imports and runs the user's own code, by intent: it is how a
person brings their model to ``measure``, ``train`` and ``advise``. Files never name a module
(``refuse_module``: a config file's model, a store's runs); only a model spec given on the
command line or from Python does.

A user's model carries no family shape record; ``untagged_shape`` reads depth and width off
its weight layers, as ``batchbound measure`` describes any module.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from batchbound.errors import BatchboundError

USER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
ARGUMENTS = ("input_shape", "num_outputs", "seed")


# a file's path where the module's import name belongs: ./mymodels:f, src/mymodels.py:f
PATH_SPEC = re.compile(
    r"(?P<path>[^:()=,]*[/\\][^:()=,]*|[^:()=,]*\.py):(?P<callable>[A-Za-z_]\w*)")


def is_user_spec(spec: object) -> bool:
    """Whether ``spec`` names a user's factory (``module:callable``) rather than a family.
    A file's path before the colon is refused here, naming the form to write: it would
    otherwise be read as a family spec and called malformed."""
    if not isinstance(spec, str):
        return False
    path = PATH_SPEC.fullmatch(spec.strip())
    if path:
        file = path["path"].replace("\\", "/")
        folder, _, name = file.rpartition("/")
        module = name.removesuffix(".py")
        where = (f"run from {folder} or put it on PYTHONPATH, and "
                 if folder not in ("", ".") else "")
        raise BatchboundError(
            f"model {spec.strip()}: MODULE:CALLABLE takes the module's import name, not a "
            f"file: {where}write {module}:{path['callable']}")
    return USER_SPEC.fullmatch(spec.strip()) is not None


def refuse_module(spec: object, source: str, instead: str = "") -> None:
    """A model named in a file (a config, a store's run) that is a ``MODULE:CALLABLE``:
    refused, as no file a user hands batchbound may make it import and run code.
    ``instead``: what to do (default: name it on the command line)."""
    if isinstance(spec, str) and is_user_spec(spec):
        raise BatchboundError(
            f"{source}: model {spec.strip()} names a Python module, and batchbound imports no "
            "code that a file names; "
            + (instead or f"give your own factory on the command line (--model {spec.strip()})"))


def load_factory(spec: str) -> Any:
    """The callable ``spec`` names, imported with the current directory on the path."""
    module_name, _, attribute = spec.strip().partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's folder first
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise BatchboundError(
                f"model {spec}: no module {exc.name!r} in the current directory "
                f"({os.getcwd()}) or on PYTHONPATH") from None
        raise BatchboundError(f"model {spec}: importing {module_name} failed: {exc}") from exc
    except SystemExit as exc:  # it would end batchbound silently, with its exit code
        raise BatchboundError(
            f"model {spec}: importing {module_name} called sys.exit({exc.code!r}); a model's "
            "module must not exit when imported (put its script under "
            "`if __name__ == \"__main__\":`)"
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise BatchboundError(
            f"model {spec}: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise BatchboundError(f"model {spec}: {module_name} has no callable {attribute!r}")
    return factory


def build_user_model(spec: str, input_shape: Sequence[int], num_outputs: int,
                     seed: int) -> nn.Module:
    """Call the factory with the arguments its signature names; it must return a Module."""
    factory = load_factory(spec)
    given = {"input_shape": tuple(input_shape), "num_outputs": num_outputs, "seed": seed}
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        parameters = {}
    kwargs = {name: given[name] for name in ARGUMENTS if name in parameters}
    try:
        model = factory(**kwargs)
    except (Exception, SystemExit) as exc:
        raise BatchboundError(f"model {spec}: calling it with {sorted(kwargs) or 'nothing'} "
                              f"raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise BatchboundError(f"model {spec} returned a {type(model).__name__}, not a "
                              "torch.nn.Module")
    return model


def weight_layers(model: nn.Module) -> list[nn.Module]:
    """Linear and convolution modules, in registration order."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [m for m in model.modules() if isinstance(m, kinds)]


def untagged_shape(model: nn.Module) -> tuple[int, int]:
    """(depth, width) of any module: weight layers − 1, and the widest output of all but the
    last weight layer (0 for a single layer)."""
    layers = weight_layers(model)
    widths = [getattr(m, "out_features", None) or getattr(m, "out_channels", 0)
              for m in layers[:-1]]
    return max(len(layers) - 1, 0), max(widths, default=0)


def probe_user_model(spec: str, model: nn.Module, example: torch.Tensor, num_outputs: int,
                     task: str) -> None:
    """Run the model on one example of the data before any work, so that a model whose
    input size does not fit the data, or whose output does not fit the task, is one line
    naming both shapes (it was a long traceback from the first training step). In eval mode,
    each module's mode restored after: one example in train mode is no batch for BatchNorm
    ("Expected more than 1 value per channel"), and it would move running statistics and
    draw dropout masks from a seeded run's random state."""
    shape = tuple(example.shape[1:])
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            out = model.eval()(example)
    except Exception as exc:  # the user's forward on the data's example: name the shapes
        raise BatchboundError(
            f"model {spec} does not take this data's examples: one example of shape {shape} "
            f"({str(example.dtype).removeprefix('torch.')}) raised {type(exc).__name__}: "
            f"{' '.join(str(exc).split())}") from None
    finally:
        for module, training in modes:
            module.training = training
    expected = (1, shape[0], num_outputs) if task == "text" else (1, num_outputs)
    found = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if found != expected:
        what = (f"(batch, {shape[0]} positions, {num_outputs} token scores)" if task == "text"
                else f"(batch, {num_outputs})")
        raise BatchboundError(
            f"model {spec} returns {found} for one example of shape {shape}; this "
            f"{task} data needs {what}, i.e. {expected}")
