"""The models a server serves: zoo models (random weights, the same ``opweave.zoo.create(name)`` gives, so a client
can check its answers) or the user's own ``torch.export`` or TorchScript files, captured and split into blocks, with
the tensor specs the Open Inference Protocol reports (names, shapes with -1 for the batch dimension, datatypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from opweave.errors import UsageError
from opweave.serve.engine.blocks import BlockedModel, split

# KServe v2 / Triton datatypes of the torch dtypes a served model may take or give.
DATATYPES = {torch.bool: "BOOL", torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32",
             torch.int64: "INT64", torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32",
             torch.float64: "FP64"}
DTYPES = {v: k for k, v in DATATYPES.items()}
# Names the protocol's routes take where a model's name would go: ``GET /v2/models/stats`` is the statistics of every
# model (the statistics extension), so a model named ``stats`` could never be asked for its metadata.
RESERVED_NAMES = frozenset({"stats"})


def reserved(name: str, what: str = "model name") -> str | None:
    """Why ``name`` cannot name a model (one of :data:`RESERVED_NAMES`), or None."""
    if name in RESERVED_NAMES:
        return f"{what} {name!r} is taken by the route /v2/models/{name}: serve the model under another name"
    return None


def check_name(name: str, what: str = "model name") -> None:
    """:class:`~opweave.errors.UsageError` if ``name`` is one of :data:`RESERVED_NAMES`."""
    why = reserved(name, what)
    if why is not None:
        raise UsageError(why)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the protocol describes it; ``shape[0]`` is -1 when requests may carry any batch."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.datatype]

    def to_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(eq=False)
class ServedModel:
    name: str
    blocked: BlockedModel
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int
    source: str  # where it came from, as metadata shows it: a zoo name, a file's name, a path under the repository
    version: str = "1"  # the version directory it came from (a model repository), else 1
    allow_non_finite: bool = False  # inputs may hold NaN and infinities (its config says so; protocol.decode_request)


def parse_model_files(items: list[str] | None) -> dict[str, Path]:
    """``--model-file`` items as a dict: ``PATH.pt2`` as every command takes it (served under its file name without
    the suffix) or ``NAME=PATH.pt2`` (served as ``NAME``)."""
    out: dict[str, Path] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not name or not path:
            raise UsageError(f"--model-file {item!r} must be PATH.pt2 or NAME=PATH.pt2")
        if name in out:
            raise UsageError(f"--model-file: two models named {name!r} (give NAME=PATH.pt2)")
        check_name(name, "--model-file")
        if not Path(path).is_file():
            raise UsageError(f"--model-file {name}: no file {path!r}")
        out[name] = Path(path)
    return out


def load(name: str, *, path: Path | None = None, device: str = "cpu", max_batch: int = 8,
         image_size: int | None = None, cuts: list[str] | None = None,
         example_inputs: tuple | dict | None = None) -> ServedModel:
    """Load, capture and split one model (:func:`opweave.capture.load`, one op per fx node): the zoo's ``name``
    (``image_size`` goes to zoo models that take one), the ``torch.export`` program at ``path`` (its example
    inputs, or zeros of its input shapes, capture it), or the TorchScript module at ``path`` (a ``.pt`` file,
    captured on ``example_inputs``; given by name, its inputs keep those names). Parameters stop requiring
    gradients (serving never trains)."""
    from opweave import capture, zoo

    module, example, captured = capture.load(path or name, image_size=image_size, device=device, coarsen=False,
                                             name=name, example_inputs=example_inputs)
    if path is not None:
        if module.keywords:
            raise UsageError(f"--model-file {name}: keyword inputs are not supported")
        source = Path(path).name  # what metadata shows: never a directory of the server
    else:
        sized = image_size is not None and zoo.takes_image_size(name)
        source = f"zoo:{name}" + (f",image_size={image_size}" if sized else "")
    for p in captured.gm.parameters():
        p.requires_grad_(False)
    blocked = split(captured, example, cuts=cuts, name=name)
    batch = max_batch if blocked.stackable else 1
    names = getattr(module, "input_names", None) or [node.name for node in blocked.input_values]
    inputs = tuple(_spec(n, x, blocked.stackable) for n, x in
                   zip(names, blocked.flat_inputs(example), strict=True))
    with torch.no_grad():
        result = blocked.run(*example)
    leaves = pytree.tree_leaves(result)
    outputs = tuple(_spec(f"output__{i}", t, blocked.stackable) for i, t in enumerate(leaves))
    return ServedModel(name, blocked, inputs, outputs, batch, source)


def _spec(name: str, value, stackable: bool) -> TensorSpec:
    if not isinstance(value, torch.Tensor) or value.dtype not in DATATYPES:
        raise UsageError(f"{name}: only tensors of {', '.join(str(d) for d in DATATYPES)} can be served, "
                         f"got {type(value).__name__}")
    shape = tuple(value.shape)
    return TensorSpec(name, DATATYPES[value.dtype], ((-1,) + shape[1:]) if stackable else shape)


__all__ = ["DATATYPES", "DTYPES", "RESERVED_NAMES", "ServedModel", "TensorSpec", "check_name", "load",
           "parse_model_files", "reserved"]
