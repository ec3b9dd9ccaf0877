"""Where a model comes from: a zoo name or a ``.pt2`` file, built, captured and coarsened (:func:`load`), the one
path the commands, the server, the coverage list and the benchmarks take from a name to a :class:`Captured`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from opweave import zoo
from opweave.capture.coarsen import coarsen as coarsen_ops
from opweave.capture.runtime import Captured
from opweave.capture.trace import ExportedModule, capture
from opweave.errors import UsageError, first_line


class Loaded(NamedTuple):
    """A model, its example inputs (on the device asked for) and its capture."""

    module: nn.Module
    inputs: tuple
    captured: Captured


def load(source: str | Path, *, batch_size: int = 1, image_size: int | None = None, device: str = "cpu",
         dtype: torch.dtype | None = None, coarsen: bool = True, name: str | None = None, fold_bn: bool = False,
         **options) -> Loaded:
    """The model ``source`` names, its example inputs and its capture, coarsened (:func:`~.coarsen.coarsen`, the
    papers' operators) unless ``coarsen=False`` (one op per fx node).

    ``source`` is a ``.pt2`` file written by ``torch.export.save`` (a :class:`~pathlib.Path`, or a string ending in
    ``.pt2``; :func:`load_program`) or a zoo name (:func:`opweave.zoo.create` at ``batch_size`` with ``options``).
    ``image_size`` goes to the zoo models that take one (:func:`opweave.zoo.takes_image_size`) and is ignored by the
    others and by files, so a caller may give one size for every model. The module and the floating-point inputs
    are converted to ``dtype`` (zoo models only), then moved to ``device``. ``name`` names the graph (default: the
    zoo name or the file's stem). ``fold_bn``: BatchNorm folded into the convolutions at capture
    (:func:`~.trace.capture`).
    """
    if isinstance(source, Path) or str(source).endswith(".pt2"):
        file = Path(source).name
        if batch_size != 1:
            raise UsageError(f"--batch-size does not apply to {file}: an exported program's shapes are fixed")
        if dtype is not None or options:
            raise UsageError(f"{file}: an exported program takes no dtype or model options")
        module = load_program(source, device=device)
        inputs, name = module.example_inputs, name or Path(source).stem
    else:
        if image_size is not None and zoo.takes_image_size(str(source)):
            options["image_size"] = image_size
        module, inputs = zoo.create(str(source), batch_size=batch_size, **options)
        if dtype is not None:
            module = module.to(dtype)
            inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        module, inputs, name = module.to(device), tuple(x.to(device) for x in inputs), name or str(source)
    captured = capture(module, inputs, name=name, fold_bn=fold_bn)
    return Loaded(module, inputs, coarsen_ops(captured) if coarsen else captured)


def load_program(path: str | Path, device: str = "cpu") -> ExportedModule:
    """The ``ExportedProgram`` saved at ``path`` by ``torch.export.save`` (a ``.pt2`` file), on ``device``, as an
    :class:`ExportedModule` whose ``.example_inputs`` are the program's own (keyword arguments bound by position),
    else zeros of the shapes and dtypes its inputs were exported with."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no model file {str(path)!r}")
    try:
        program = torch.export.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read means "not an exported program"
        raise UsageError(f"{str(path)!r} is not a program saved by torch.export.save ({first_line(exc)})") from exc
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = ExportedModule(program)
    if module.example_inputs is None:
        raise UsageError(f"{path.name} has no example inputs, and not all its inputs are tensors to make zeros of")
    return module


__all__ = ["Loaded", "load", "load_program"]
