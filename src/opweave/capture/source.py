"""Where a model comes from: a zoo name, a ``.pt2`` file or a TorchScript ``.pt`` file, built, captured and coarsened
(:func:`load`), the one path the commands, the server, the coverage list and the benchmarks take from a name to a
:class:`Captured`."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from opweave import zoo
from opweave.capture.coarsen import coarsen as coarsen_ops
from opweave.capture.runtime import Captured
from opweave.capture.trace import ExportedModule, capture
from opweave.errors import CaptureError, UsageError, first_line
from opweave.outputs import compare

# The functional form keeps the fields' types objects, not strings that only this module could resolve.
Loaded = NamedTuple("Loaded", [("module", nn.Module), ("inputs", tuple), ("captured", Captured)])  # noqa: UP014
Loaded.__doc__ = "A model, its example inputs (on the device asked for) and its capture."


def load(source: str | Path, *, batch_size: int = 1, image_size: int | None = None, device: str = "cpu",
         dtype: torch.dtype | None = None, coarsen: bool = True, name: str | None = None, fold_bn: bool = False,
         example_inputs: tuple | dict | None = None, **options) -> Loaded:
    """The model ``source`` names, its example inputs and its capture, coarsened (:func:`~.coarsen.coarsen`, the
    papers' operators) unless ``coarsen=False`` (one op per fx node).

    ``source`` is a ``.pt2`` file written by ``torch.export.save`` (a :class:`~pathlib.Path`, or a string ending in
    ``.pt2``; :func:`load_program`), a TorchScript module written by ``torch.jit.save`` (a file ending in ``.pt``,
    Triton's PyTorch layout; :func:`load_torchscript` on ``example_inputs``, which such a file does not carry) or a
    zoo name (:func:`opweave.zoo.create` at ``batch_size`` with ``options``).
    ``image_size`` goes to the zoo models that take one (:func:`opweave.zoo.takes_image_size`) and is ignored by the
    others and by files, so a caller may give one size for every model. The module and the floating-point inputs
    are converted to ``dtype`` (zoo models only), then moved to ``device``. ``name`` names the graph (default: the
    zoo name or the file's stem). ``fold_bn``: BatchNorm folded into the convolutions at capture
    (:func:`~.trace.capture`).
    """
    module: torch.nn.Module
    if isinstance(source, Path) or str(source).endswith((".pt2", ".pt")):
        file = Path(source).name
        if batch_size != 1:
            raise UsageError(f"--batch-size does not apply to {file}: an exported program's shapes are fixed")
        if dtype is not None or options:
            raise UsageError(f"{file}: an exported program takes no dtype or model options")
        if Path(source).suffix == ".pt":
            if example_inputs is None:
                raise UsageError(f"{file} is TorchScript, which does not record its inputs' shapes: give example "
                                 f"inputs (a model repository's config.pbtxt lists them)")
            exported = load_torchscript(source, example_inputs, device=device)
        else:
            exported = load_program(source, device=device)
        assert exported.example_inputs is not None  # both loaders refuse a model they cannot give inputs
        module, inputs, name = exported, exported.example_inputs, name or Path(source).stem
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


class _Told(logging.Filter):
    """Keeps what ``torch.export.load`` logs with a traceback about a file it cannot read (it then raises an error
    that says "check the warnings above", which only a server's log would hold) and drops it from the log: the
    error's reason is told instead, once, in the exception."""

    reason: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            self.reason = self.reason or first_line(record.exc_info[1]).split(". ", 1)[0]
            return False
        return True


def load_program(path: str | Path, device: str = "cpu") -> ExportedModule:
    """The ``ExportedProgram`` saved at ``path`` by ``torch.export.save`` (a ``.pt2`` file), on ``device``, as an
    :class:`ExportedModule` whose ``.example_inputs`` are the program's own (keyword arguments bound by position),
    else zeros of the shapes and dtypes its inputs were exported with."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no model file {str(path)!r}")
    told = _Told()
    export_log = logging.getLogger("torch.export")
    export_log.addFilter(told)
    try:
        program = torch.export.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read means "not an exported program"
        why = told.reason or first_line(exc)
        raise UsageError(f"{str(path)!r} is not a program saved by torch.export.save ({why})") from exc
    finally:
        export_log.removeFilter(told)
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = ExportedModule(program)
    if module.example_inputs is None:
        raise UsageError(f"{path.name} has no example inputs, and not all its inputs are tensors to make zeros of")
    return module


def load_torchscript(path: str | Path, example_inputs: tuple | dict, device: str = "cpu") -> ExportedModule:
    """The TorchScript module saved at ``path`` by ``torch.jit.save`` (Triton's PyTorch ``model.pt``), on ``device``,
    converted to an ``ExportedProgram`` by torch's TorchScript converter (``torch._export.converter.TS2EPConverter``,
    which rebuilds the script's graph in fx and exports it on the example inputs) and checked equal to the TorchScript
    module on them (:func:`opweave.outputs.compare`): an :class:`ExportedModule` whose ``example_inputs`` are those.

    ``example_inputs`` by position, or by name as Triton's PyTorch backend names a TorchScript model's inputs: all
    ``<name>__<index>`` (``INPUT__0``: the index is the position), or else the names of ``forward``'s arguments. Named,
    the module's ``input_names`` are those names in the order of ``forward``'s arguments.

    A file that is not TorchScript, or names that are neither, raise :class:`UsageError`; a module the converter
    cannot convert, or converts into something that answers otherwise, :class:`CaptureError` with the reason."""
    from torch._export.converter import TS2EPConverter

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no model file {str(path)!r}")
    try:
        script = torch.jit.load(str(path), map_location=device)
    except Exception as exc:  # noqa: BLE001 - any failure to read means "not TorchScript"
        raise UsageError(f"{path.name} is not a TorchScript module saved by torch.jit.save ({first_line(exc)})"
                         ) from None
    script.eval()
    names = None
    if isinstance(example_inputs, dict):
        names = _argument_order(path.name, list(example_inputs), script)
        example_inputs = tuple(example_inputs[n] for n in names)
    inputs = tuple(x.to(device) for x in example_inputs)
    try:
        with _quiet():
            program = TS2EPConverter(script, inputs).convert()
        module = ExportedModule(program)
        with torch.no_grad():
            want, got = script(*inputs), module(*inputs)
    except Exception as exc:  # noqa: BLE001 - whatever the converter or the converted program raised
        raise CaptureError(f"{path.name}: torch's TorchScript converter cannot convert it ({first_line(exc)})"
                           ) from None
    verdict = compare(want, got)
    if not verdict.ok:
        raise CaptureError(f"{path.name}: converted from TorchScript, it does not answer as the TorchScript module "
                           f"does ({verdict.reason})")
    module.example_inputs, module.input_names = inputs, names
    return module


def _argument_order(file: str, names: list[str], script) -> list[str]:
    """``names`` in the order ``script``'s forward takes them (:func:`load_torchscript`)."""
    indexed = [n.rpartition("__") for n in names]
    if all(sep and index.isdigit() for _, sep, index in indexed):
        order = sorted(range(len(names)), key=lambda i: int(indexed[i][2]))
        if [int(indexed[i][2]) for i in order] == list(range(len(names))):
            return [names[i] for i in order]
        raise UsageError(f"{file}: inputs {names} must be numbered __0 to __{len(names) - 1}, one each")
    arguments = [a.name for a in script.forward.schema.arguments[1:]]
    if sorted(arguments) != sorted(names):
        raise UsageError(f"{file}: inputs {names} are neither forward's arguments {arguments} nor named "
                         f"<name>__<index> by position")
    return arguments


QUIET_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export.non_strict_utils", "torch._export.converter",
                 "torch.export")


@contextlib.contextmanager
def _quiet():
    """Silences what the TorchScript converter writes while it works: the symbolic-shape solver's warnings (it
    exports with every dimension automatic) and its notes on the state it copies over."""
    loggers = [(logging.getLogger(n), logging.getLogger(n).level) for n in QUIET_LOGGERS]
    for logger, _ in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in loggers:
            logger.setLevel(level)


__all__ = ["Loaded", "load", "load_program", "load_torchscript"]
