"""``opweave export``: a model written as an entry of a model repository (Triton's layout, :mod:`.layout`) that
``opweave serve --model-repository`` serves as it is::

    REPO/<name>/config.pbtxt          name, max_batch_size, every input and output: name, data_type, dims
    REPO/<name>/<version>/model.pt2   torch.export.save of torch.export.export(model, example_inputs)

The model is a zoo name, ``timm:<name>`` or ``hf:<name>`` (:func:`opweave.zoo.create`: random weights, never a
download) or the user's own (:func:`from_factory`: ``pkg.module:function`` returning ``(model, example_inputs)``).
The config says what the server will serve, because it is read off the program loaded as the server loads it
(:func:`opweave.serve.models.load`): the inputs' names (the program's arguments), datatypes and shapes, and
``max_batch_size`` (``max_batch`` where requests may stack along the first dimension, without it in ``dims``; else 0,
Triton's "does not batch", with the whole shape), a dimension exported free (``--free-dim``: a sequence length) as -1.
Nothing of the entry is written unless that load succeeds (the
repository's directory is created for the staging), and an existing entry is replaced only when asked (``force``).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from opweave.errors import UsageError, did_you_mean, first_line
from opweave.serve.models import ServedModel, TensorSpec, load
from opweave.serve.repository.layout import CONFIG, MODEL_FILE, NAME

FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def entry_name(source: str) -> str:
    """The repository name a model source gets by default: the name after its ``timm:`` / ``hf:`` prefix, every
    character a plain name may not hold (``/``, ``:``, ...) as ``_``."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", source.partition(":")[2] or source).lstrip(".")
    return name[:128] or "model"


def from_zoo(name: str, image_size: int | None = None) -> tuple[nn.Module, tuple]:
    """A zoo, ``timm:`` or ``hf:`` model with random weights and its example inputs at batch 1."""
    from opweave import zoo

    options = {"image_size": image_size} if image_size is not None and zoo.takes_image_size(name) else {}
    return zoo.create(name, **options)


def from_factory(spec: str) -> tuple[nn.Module, tuple]:
    """``pkg.module:function`` imported (the current directory first on the path, as ``python -m`` has it) and called
    with no argument; it must return ``(model, example_inputs)``."""
    if not FACTORY.fullmatch(spec):
        raise UsageError(f"--module {spec!r} must be MODULE:FUNCTION (e.g. mypkg.models:build)")
    module_name, _, function = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--module {spec}: {first_line(exc)}") from None
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise UsageError(f"--module {spec}: {function}() must return (model, example_inputs), got "
                         f"{type(made).__name__}")
    model, inputs = made
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def parse_free_dims(items: list[str] | None) -> list[tuple[list[tuple[str, int]], int, int]]:
    """``--free-dim`` items, ``INPUT:DIM[,INPUT:DIM...]=MIN-MAX``: dimensions whose size may vary between requests
    (a sequence length), one size for every dimension an item names (they are equal in each request), within
    MIN..MAX."""
    out = []
    for item in items or []:
        dims, sep, span = item.partition("=")
        low, dash, high = span.partition("-")
        named = [d.rpartition(":") for d in dims.split(",")]
        if not sep or not dash or not low.isdigit() or not high.isdigit() or \
                not all(n and colon and d.isdigit() for n, colon, d in named):
            raise UsageError(f"--free-dim {item!r} must be INPUT:DIM[,INPUT:DIM...]=MIN-MAX, e.g. input_ids:1=8-128")
        if not 1 <= int(low) <= int(high):
            raise UsageError(f"--free-dim {item!r}: MIN-MAX must be a range of positive sizes")
        out.append(([(n, int(d)) for n, _, d in named], int(low), int(high)))
    return out


def dynamic_shapes(model: nn.Module, example_inputs: tuple, free: list[tuple[list[tuple[str, int]], int, int]]
                   ) -> dict | None:
    """``torch.export``'s ``dynamic_shapes`` for ``free`` (:func:`parse_free_dims`), keyed by ``forward``'s argument
    names: one ``Dim`` per item."""
    if not free:
        return None
    import inspect

    names = list(inspect.signature(model.forward).parameters)[:len(example_inputs)]
    shapes: dict[str, dict | None] = dict.fromkeys(names)
    for k, (dims, low, high) in enumerate(free):
        dim = torch.export.Dim(f"free{k}", min=low, max=high)
        for input_name, axis in dims:
            if input_name not in shapes:
                raise UsageError(f"--free-dim: the model takes no input {input_name!r} (its inputs: "
                                 f"{', '.join(names)}){did_you_mean(input_name, names)}")
            x = example_inputs[names.index(input_name)]
            if not isinstance(x, torch.Tensor) or not 0 <= axis < x.dim():
                raise UsageError(f"--free-dim: input {input_name!r} has no dimension {axis}")
            shapes[input_name] = {**(shapes[input_name] or {}), axis: dim}
    return shapes


def export(model: nn.Module, example_inputs: tuple, root: str | Path, name: str, *, version: int = 1,
           max_batch: int = 8, force: bool = False,
           free: list[tuple[list[tuple[str, int]], int, int]] | None = None) -> ServedModel:
    """Write ``model`` (in eval mode) as entry ``name``, version ``version``, of the repository at ``root`` (created if
    missing), see the module docstring; returns the model as the server will serve it. ``free``: dimensions whose
    size may vary between requests (:func:`parse_free_dims`), exported free: the config gives them as -1 and the
    server takes any size in their range."""
    if not NAME.fullmatch(name):
        raise UsageError(f"model name {name!r} is not a plain name (letters, digits, '_', '-', '.', not starting "
                         f"with '.', at most 128 characters): give --name")
    if version < 1:
        raise UsageError(f"--version must be a positive integer, got {version}")
    root = Path(root)
    entry = root / name
    program_path, config_path = entry / str(version) / MODEL_FILE, entry / CONFIG
    if not force and (program_path.exists() or config_path.exists()):
        raise UsageError(f"{entry} already holds {program_path.name if program_path.exists() else CONFIG} "
                         f"(--force replaces it)")
    try:
        with torch.no_grad():
            program = torch.export.export(model.eval(), tuple(example_inputs), strict=False,
                                          dynamic_shapes=dynamic_shapes(model, tuple(example_inputs), free or []))
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever torch.export raised, said in one line
        raise UsageError(f"{name}: torch.export cannot export it ({first_line(exc)})") from None
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=root) as staging:  # beside the entry: replaces are atomic
        staged, staged_config = Path(staging) / MODEL_FILE, Path(staging) / CONFIG
        torch.export.save(program, str(staged))
        served = load(name, path=staged, max_batch=max_batch)
        staged_config.write_text(config_text(served, max_batch))
        program_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged_config, config_path)  # both written before either replaces; the program last
        os.replace(staged, program_path)
    return served


def config_text(model: ServedModel, max_batch: int) -> str:
    """``model``'s ``config.pbtxt`` (module docstring)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    batched = all(s.shape[:1] == (-1,) for s in (*model.inputs, *model.outputs))
    config = model_config_pb2.ModelConfig(name=model.name, max_batch_size=max_batch if batched else 0)

    def tensor(spec: TensorSpec) -> dict:
        return {"name": spec.name, "data_type": model_config_pb2.DataType.Value(f"TYPE_{spec.datatype}"),
                "dims": list(spec.shape[1:] if batched else spec.shape)}

    config.input.extend(model_config_pb2.ModelInput(**tensor(s)) for s in model.inputs)
    config.output.extend(model_config_pb2.ModelOutput(**tensor(s)) for s in model.outputs)
    return "# written by opweave export: what opweave serve --model-repository serves\n" + \
        text_format.MessageToString(config)


__all__ = ["config_text", "dynamic_shapes", "entry_name", "export", "from_factory", "from_zoo", "parse_free_dims"]
