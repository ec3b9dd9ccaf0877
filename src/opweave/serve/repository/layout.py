"""A model repository on disk, in Triton's layout, and what its configs say.

Layout (``opweave serve --model-repository DIR``)::

    DIR/<name>/config.pbtxt        Triton's ModelConfig in protobuf text format (optional for a model.pt2)
    DIR/<name>/<version>/model.pt2 a torch.export program (torch.export.save); version a positive integer
    DIR/<name>/<version>/model.pt  or TorchScript (torch.jit.save: Triton's PyTorch backend's layout)

A TorchScript ``model.pt`` records no input shapes: its ``config.pbtxt`` must list every input (``name``,
``data_type``, fixed ``dims``, without the batch dimension when ``max_batch_size`` > 0), as Triton's PyTorch backend
requires. It is converted to a torch.export program (:func:`opweave.capture.load_torchscript`: torch's TorchScript
converter, checked equal to the TorchScript module on the config's shapes) and served as one. Its inputs keep the
config's names (``<name>__<index>`` by position, or ``forward``'s argument names), and its outputs take the names
of the config's ``output`` list (``<name>__<index>`` by position, else in order; ``output__<i>`` without one). A
version directory that holds files but neither program (a ``model.onnx``, a ``model.savedmodel``) makes its model
UNAVAILABLE with that reason, never silently absent.

The version served is the highest present (Triton's default ``latest`` policy) or, with ``version_policy { specific
{ versions: [...] } }``, the highest of those listed. Of ``config.pbtxt`` opweave reads ``name`` (if set, the
directory's), ``max_batch_size`` (samples per instance; 0 is Triton's "does not batch": 1; unset: the server's
``--max-batch``), ``input`` (if listed, their names must be the program's inputs: opweave names inputs after the
program's arguments and does not rename them; for TorchScript, above) and ``model_warmup``'s batch sizes (the batches
whose compiled variants are built before the model serves, where its blocks are compiled per batch; others are built
when first asked for); the rest (platform, backend, instance groups, ...) is not opweave's to follow and is ignored,
but for one parameter: ``parameters { key: "allow_non_finite_inputs"
value { string_value: "true" } }`` lets the model's inputs hold NaN and infinities (refused otherwise). A load
request may carry the config instead (``parameters.config``: its JSON form, as ``tritonclient``'s ``load_model(name,
config=...)`` sends it); it holds for that load only.

Here: the names, the version directories and their programs (:func:`versions_in`, :func:`program_in`), and a
config's reading for a model (:func:`torchscript_inputs`, :func:`named_outputs`, :func:`warmup_batches`,
:func:`allows_non_finite`, :func:`settings_of`); :class:`~opweave.serve.repository.repository.Repository` loads and
unloads by them while the server runs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from opweave.serve.frontend import Refused
from opweave.serve.models import DTYPES, TensorSpec
from opweave.serve.protocol import NON_FINITE_PARAMETER, shown

CONFIG = "config.pbtxt"
MODEL_FILES = ("model.pt2", "model.pt")  # what a version directory serves: a torch.export program, else TorchScript
MAX_EXAMPLE_BYTES = 256 << 20  # the most a TorchScript model's example inputs (batch 1, from its config) may take
MODEL_FILE = MODEL_FILES[0]
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")  # a model name of the repository (fullmatch)
MAX_BATCH_SIZE = 1024  # the largest max_batch_size a config.pbtxt may set
MAX_CONFIG_CHARS = 1 << 20  # a load request's parameters.config


def warmup_batches(config) -> tuple[int, ...]:
    """The batch sizes of ``config``'s ``model_warmup`` entries (Triton's: samples the model is run on before it
    serves), those above 0."""
    return tuple(sorted({w.batch_size for w in config.model_warmup if w.batch_size > 0}))


def version_dirs(folder: Path) -> list[Path]:
    """The version directories under ``folder``: named by a positive integer as written (``1``, not ``01``)."""
    return [d for d in folder.iterdir()
            if d.name.isascii() and d.name.isdigit() and d.name == str(int(d.name)) and int(d.name) > 0 and d.is_dir()]


def program_in(version: Path) -> Path | None:
    """The program a version directory serves: the first of :data:`MODEL_FILES` it holds."""
    return next((version / f for f in MODEL_FILES if (version / f).is_file()), None)


def versions_in(folder: Path) -> list[int]:
    """The versions under ``folder`` that hold a program."""
    return sorted(int(d.name) for d in version_dirs(folder) if program_in(d) is not None)


def torchscript_inputs(name: str, config) -> dict:
    """Example inputs of a TorchScript model by name, from its config's ``input`` list (module docstring): the
    batch dimension 1 in front of ``dims`` when ``max_batch_size`` > 0; floating-point values random (seeded), so
    that the conversion is checked on values that tell outputs apart, integers and booleans zero (valid indices)."""
    from tritonclient.grpc import model_config_pb2

    if not config.input:
        raise Refused("invalid", f"model {name!r}: a TorchScript model.pt records no input shapes: list its inputs "
                                 f"(name, data_type, dims) in {CONFIG}, as Triton's PyTorch backend requires")
    generator = torch.Generator().manual_seed(0)
    out, total = {}, 0
    for tensor in config.input:
        datatype = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
        if datatype not in DTYPES:
            raise Refused("invalid", f"model {name!r}: input {shown(tensor.name)} has data_type TYPE_{datatype}, "
                                     f"which opweave cannot serve (it serves {', '.join(DTYPES)})")
        dims = list(tensor.dims)
        if any(d < 1 for d in dims):
            raise Refused("invalid", f"model {name!r}: input {shown(tensor.name)} has a variable dimension in dims "
                                     f"{dims[:8]}: opweave captures fixed shapes, give every dimension")
        shape = ([1] if config.max_batch_size > 0 else []) + dims
        dtype = DTYPES[datatype]
        total += math.prod(shape) * dtype.itemsize
        if total > MAX_EXAMPLE_BYTES:  # checked before allocating: a load request may carry this config
            raise Refused("invalid", f"model {name!r}: the inputs of its config take over "
                                     f"{MAX_EXAMPLE_BYTES >> 20} MiB at batch 1 (input {shown(tensor.name)}, dims "
                                     f"{dims[:8]}): opweave serves no model whose one example is that large")
        out[tensor.name] = torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point else \
            torch.zeros(shape, dtype=dtype)
    return out


def named_outputs(name: str, config, outputs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """A TorchScript model's outputs named after its config's ``output`` list (module docstring); unchanged
    without one."""
    listed = list(config.output)
    if not listed:
        return outputs
    if len(listed) != len(outputs):
        raise Refused("invalid", f"model {name!r}: its config lists {len(listed)} outputs, the module gives "
                                 f"{len(outputs)}")
    indexed = [o.name.rpartition("__") for o in listed]
    if all(sep and index.isdigit() for _, sep, index in indexed) and \
            sorted(int(index) for _, _, index in indexed) == list(range(len(listed))):
        listed = sorted(listed, key=lambda o: int(o.name.rpartition("__")[2]))
    from tritonclient.grpc import model_config_pb2

    for o, spec in zip(listed, outputs, strict=True):
        datatype = model_config_pb2.DataType.Name(o.data_type).removeprefix("TYPE_")
        if o.data_type and datatype != spec.datatype:
            raise Refused("invalid", f"model {name!r}: its config gives output {shown(o.name)} data_type "
                                     f"TYPE_{datatype}, the module answers {spec.datatype}")
    return tuple(TensorSpec(o.name, spec.datatype, spec.shape) for o, spec in zip(listed, outputs, strict=True))


def settings_of(name: str, config) -> bytes:
    """What a model's config says, as bytes that are equal for equal configs (whichever form carried it: a
    ``config.pbtxt`` or a load's ``parameters.config``)."""
    config = type(config).FromString(config.SerializeToString())
    config.name = name
    return config.SerializeToString(deterministic=True)


def allows_non_finite(name: str, config) -> bool:
    """Whether ``config`` lets the model's inputs hold NaN and infinities (its parameter
    :data:`~opweave.serve.protocol.NON_FINITE_PARAMETER`, ``"true"`` or ``"false"``)."""
    if NON_FINITE_PARAMETER not in config.parameters:
        return False
    value = config.parameters[NON_FINITE_PARAMETER].string_value
    if value not in ("true", "false"):
        raise Refused("invalid", f"model {name!r}: its config's parameter {NON_FINITE_PARAMETER} is "
                                 f"{shown(value)}, not \"true\" or \"false\"")
    return value == "true"


def declares_no_batching(config) -> bool:
    """A config file that exists and leaves ``max_batch_size`` 0 (Triton: the model does not batch) — told apart from
    no config by having any field set."""
    return config.ByteSize() > 0 and config.max_batch_size == 0


__all__ = ["CONFIG", "MAX_BATCH_SIZE", "MAX_CONFIG_CHARS", "MAX_EXAMPLE_BYTES", "MODEL_FILE", "MODEL_FILES", "NAME",
           "allows_non_finite", "declares_no_batching", "named_outputs", "program_in", "settings_of",
           "torchscript_inputs", "version_dirs", "versions_in", "warmup_batches"]
