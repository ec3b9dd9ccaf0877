"""Which device, resolved one way for every door: the Python API and the ``torch.compile`` backend
(:func:`device_of`: where the model's tensors are), the command line and the server (:func:`resolve_device`:
``--device auto``, ``cpu`` or ``cuda``). Needs only torch."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.errors import DeviceError, UsageError, did_you_mean

NAMES = ("auto", "cpu", "cuda")


def resolve_device(device: str = "auto", gpus: int = 1) -> str:
    """``auto`` becomes ``cuda`` when ``gpus`` GPUs are visible (a command's ranks on this machine), else ``cpu``;
    ``cuda`` on a machine without one is a :class:`~opweave.errors.DeviceError`; any other name a
    :class:`~opweave.errors.UsageError`, with the name it was likely meant to be."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= gpus else "cpu"
    if device not in NAMES:
        raise UsageError(f"device must be cpu, cuda or auto, got {device!r}{did_you_mean(device, NAMES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("CUDA is not available on this machine; use --device cpu (or auto)")
    return device


def device_of(model: Any, example_inputs: Any, example_kwargs: dict | None, options: dict) -> str:
    """Where a model compiled without ``device`` runs: ``"cuda"`` when a ``runtime`` option is given or an example
    input or a parameter or buffer of the model is on a GPU, else ``"cpu"``."""
    if options.get("runtime") is not None:
        return "cuda"
    values = pytree.tree_leaves((example_inputs, example_kwargs or {}))
    if isinstance(model, torch.nn.Module):
        values += [next(model.parameters(), None), next(model.buffers(), None)]
    elif isinstance(model, torch.export.ExportedProgram):
        values += pytree.tree_leaves(model.example_inputs) + list(model.state_dict.values())[:1]
    return "cuda" if any(isinstance(v, torch.Tensor) and v.is_cuda for v in values) else "cpu"


__all__ = ["NAMES", "device_of", "resolve_device"]
