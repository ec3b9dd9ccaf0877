"""The models a server serves: zoo models (random weights, the same ``opweave.zoo.create(name)`` gives, so a client
can check its answers) or the user's own ``torch.export`` or TorchScript files, captured and split into blocks, with
the tensor specs the Open Inference Protocol reports (names, shapes with -1 for the batch dimension, datatypes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from opweave.capture.trace import size_range, user_inputs
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
    """One input or output as the protocol describes it; ``shape[0]`` is -1 when requests may carry any batch, and
    another dimension is -1 where its size may vary between requests (a sequence length), within ``ranges``: per such
    dimension ``(dimension, smallest, largest, symbol)``; the dimensions of one symbol, in any input, are equal in a
    request (an output's largest is -1: it follows from the inputs)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int, int, str], ...] = ()

    @property
    def batched(self) -> bool:
        """Whether dimension 0 is the batch (-1, and not a varying size of its own)."""
        return self.shape[:1] == (-1,) and all(r[0] != 0 for r in self.ranges)

    def largest(self, batch: int) -> tuple[int, ...]:
        """The largest shape a request at ``batch`` samples may give it."""
        top = {r[0]: r[2] for r in self.ranges}
        return tuple(batch if (i == 0 and self.batched) else top.get(i, d) for i, d in enumerate(self.shape))

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
    flat = blocked.flat_inputs(example)
    # a TorchScript module's sizes are its config's, fixed (its conversion may leave them free)
    scripted = path is not None and Path(path).suffix != ".pt2"
    free_in, free_out = ([], []) if scripted else varying(module, flat, blocked.stackable)
    if any(free_in):
        blocked.other_sizes = resized(flat, free_in)
    inputs = tuple(_spec(n, x, blocked.stackable, ranges) for n, x, ranges in
                   zip(names, flat, free_in or [()] * len(flat), strict=True))
    with torch.no_grad():
        result = blocked.run(*example)
    leaves = pytree.tree_leaves(result)
    if len(free_out) != len(leaves):
        free_out = [()] * len(leaves)
    outputs = tuple(_spec(f"output__{i}", t, blocked.stackable, ranges)
                    for i, (t, ranges) in enumerate(zip(leaves, free_out, strict=True)))
    return ServedModel(name, blocked, inputs, outputs, batch, source)


def varying(module, inputs: tuple, stackable: bool) -> tuple[list[tuple], list[tuple]]:
    """The dimensions of a ``torch.export`` program's inputs and outputs whose sizes it leaves free, besides the
    batch where instances stack: per input and per output ``((dimension, smallest, largest, symbol), ...)``. An
    input's range is the program's own, its largest the example's size where the program leaves it unbounded (the
    server bounds what a request may make it hold); dimensions of one ``symbol`` must be equal in a request (the
    program's guards say so). An output's largest is -1 (it follows from the inputs). Nothing varies in a program
    without free dimensions, or in another model."""
    program = getattr(module, "exported", None)
    if program is None:
        return [], []
    first = 1 if stackable else 0

    def free(value, example=None) -> tuple:
        out: list[tuple[int, int, int, str]] = []
        for d, size in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            if d < first or not isinstance(size, torch.SymInt):
                continue
            low, upper = size_range(program, size) or (1, math.inf)
            fixed = int(example.shape[d]) if isinstance(example, torch.Tensor) else -1
            high = int(upper) if upper != math.inf and example is not None else fixed
            out.append((d, low, high, str(size.node.expr)))
        return tuple(out)

    free_in = [free(v, x) for v, x in zip(user_inputs(program), inputs, strict=False)]
    if not any(free_in):
        return [], []
    output = next(n for n in program.graph.nodes if n.op == "output")
    returned = [spec.arg.name for spec in program.graph_signature.output_specs if spec.kind.name == "USER_OUTPUT"]
    nodes = {getattr(a, "name", None): a for a in pytree.tree_leaves(output.args)}
    free_out = [free(nodes[name].meta.get("val")) if name in nodes else () for name in returned]
    return free_in, free_out


def resized(inputs: tuple, free: list[tuple]) -> tuple:
    """``inputs`` with every free dimension (:func:`varying`) one shorter, or one longer where the range allows no
    shorter: the example's values cut, or its first ones repeated (valid token ids stay valid)."""
    chosen: dict[str, int] = {}
    out = []
    for x, dims in zip(inputs, free, strict=True):
        for d, low, high, symbol in dims:
            size = x.shape[d]
            other = chosen.setdefault(symbol, size - 1 if size - 1 >= low else size + 1)
            if other > high or other < low:
                continue
            x = x.narrow(d, 0, other) if other < size else torch.cat([x, x.narrow(d, 0, other - size)], d)
        out.append(x.contiguous() if isinstance(x, torch.Tensor) else x)
    return tuple(out)


def _spec(name: str, value, stackable: bool, ranges: tuple = ()) -> TensorSpec:
    if not isinstance(value, torch.Tensor) or value.dtype not in DATATYPES:
        raise UsageError(f"{name}: only tensors of {', '.join(str(d) for d in DATATYPES)} can be served, "
                         f"got {type(value).__name__}")
    shape = tuple(-1 if any(r[0] == i for r in ranges) else n for i, n in enumerate(value.shape))
    return TensorSpec(name, DATATYPES[value.dtype], ((-1,) + shape[1:]) if stackable else shape, tuple(ranges))


__all__ = ["DATATYPES", "DTYPES", "RESERVED_NAMES", "ServedModel", "TensorSpec", "check_name", "load",
           "parse_model_files", "reserved", "resized", "varying"]
