"""``opweave.compile``: capture → costs → scheduler → plan → backend, in one call (:mod:`opweave.pipeline`)."""

from __future__ import annotations

from pathlib import Path

import torch

from opweave.capture import capture, load_program
from opweave.capture.coarsen import at_sizes
from opweave.capture.trace import ExportedModule
from opweave.devices import device_of
from opweave.errors import UsageError
from opweave.pipeline import Compiled, Options, as_tuple, build, resolve
from opweave.pipeline.signatures import attach
from opweave.pipeline.sizes import Sizes, on_devices_of


def compile(model, example_inputs=(), *, example_kwargs: dict | None = None, device: str | None = None,
            mode: str = "default", options: dict | None = None, **kwargs) -> Compiled:
    """Compile ``model`` for ``example_inputs`` (and ``example_kwargs``, keyword arguments of its ``forward``); the
    result's outputs equal ``model(*inputs, **kwargs)`` (allclose), and compiling leaves the model unchanged.

    ``model`` is an ``nn.Module``, a ``torch.export.ExportedProgram``, or the path of a ``.pt2`` file written by
    ``torch.export.save`` (:func:`opweave.capture.load_program`); a program's own example inputs are used when none
    are given.

    ``device`` is ``"cpu"`` or ``"cuda"``; when not given it follows the example inputs and the model, as
    ``torch.compile`` does: ``"cuda"`` when one of them is on a GPU (or a ``runtime`` option is given), else
    ``"cpu"``. ``mode`` a preset that means the same on every device, as in
    ``torch.compile``: ``"default"``, ``"reduce-overhead"`` (CUDA Graphs; on CUDA opweave's default records them
    too), ``"max-autotune"`` (the fastest of a bounded set of candidates, timed on the device and cached) and
    ``"max-autotune-no-cudagraphs"``. Every other knob is an option (:data:`opweave.pipeline.OPTIONS`: its meaning,
    devices and default), given as a keyword or in ``options``, e.g. ``scheduler="lios"``, ``streams=4``,
    ``compiler="inductor"`` (every stream segment compiled by TorchInductor), ``graph="onnxruntime"`` (CPU: lanes
    over ONNX Runtime's optimized graph), ``cudagraphs=False`` (run the streams live), ``devices=2`` (one rank
    process per device, with ``hios-lp`` or ``hios-mr``). An option that does not apply where it is given is a
    :class:`~opweave.errors.UsageError`, raised before anything touches a device; a missing GPU is a
    :class:`~opweave.errors.DeviceError`.

    With no scheduler, the device chooses: on the CPU, the fastest in a short race of the model in one ONNX Runtime
    segment (with the ``onnx`` extra), HEFT on one lane per core, one lane, and the model itself (``choice`` says
    which won: :func:`opweave.pipeline.search.default_race`); on CUDA, the scheduler and
    stream cap the calibrated simulator predicts fastest (``choice`` says which and why). ``close()`` or a ``with``
    block releases worker threads, rank processes, CUDA graphs and streams.

    Two branches of a tiny model run on two CPU threads:

    >>> import torch, opweave
    >>> class Branchy(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.left, self.right = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         return torch.relu(self.left(x)) + torch.sigmoid(self.right(x))
    >>> model, x = Branchy().eval(), torch.randn(2, 8)
    >>> fast = opweave.compile(model, (x,), scheduler="lios", device="cpu")
    >>> fast.schedule.streams_used, torch.allclose(fast(x), model(x))
    (2, True)
    """
    if isinstance(model, (str, Path)):
        model = load_program(model)
    device = device or device_of(model, example_inputs, example_kwargs, {**(options or {}), **kwargs})
    return compile_with(model, example_inputs, resolve(device, mode, options, **kwargs), example_kwargs=example_kwargs)


def compile_with(model, example_inputs, options: Options, *, example_kwargs: dict | None = None) -> Compiled:
    """:func:`compile` with ``options`` resolved already (:func:`opweave.pipeline.resolve`): the torch.compile
    backend resolves a graph's options once, at its door, and hands them here."""
    captured = capture(model, as_tuple(example_inputs), example_kwargs=example_kwargs, fold_bn=options.fold_bn)
    eager = model if isinstance(model, torch.nn.Module) else None
    reference, captured.example_output = captured.example_output, None  # this build's only (runtime.Captured)
    compiled = build(captured, captured.example_inputs, options, eager=eager, reference=reference)
    return with_signatures(compiled, model, captured, options, eager)


def compile_captured(captured, example_inputs, *, device: str | None = None, mode: str = "default",
                     options: dict | None = None, eager=None, **kwargs) -> Compiled:
    """:func:`compile` from an already captured model (:func:`opweave.capture.capture`): one capture can serve many
    plans. ``eager``, the model itself, is one of the candidates the CPU default's timing may keep. ``device``
    follows the inputs and the captured model when not given, as in :func:`compile`."""
    device = device or device_of(captured.gm, example_inputs, None, {**(options or {}), **kwargs})
    opts = resolve(device, mode, options, **kwargs)
    if "fold_bn" in opts.given:
        raise UsageError("option 'fold_bn' applies when capturing: give it to opweave.compile or capture()")
    compiled = build(captured, example_inputs, opts, eager=eager)
    return with_signatures(compiled, eager if eager is not None else captured.gm, captured, opts, eager,
                           as_tuple(example_inputs))


def with_signatures(compiled: Compiled, model, captured, opts, eager, example_inputs: tuple | None = None) -> Compiled:
    """``compiled``, which now serves inputs of other sizes with its plan, checked against ``model``, and builds
    itself for inputs of another signature from ``model`` (captured again for them, with the options it was built
    with; a range of sizes planned again from ``captured`` at those sizes): :mod:`opweave.pipeline.signatures`,
    :mod:`opweave.pipeline.sizes`."""
    example = example_inputs if example_inputs is not None else captured.example_inputs

    def rebuild(args: tuple) -> Compiled:  # captured where the model runs: the example's device
        again = capture(model, on_devices_of(args, example), fold_bn=opts.fold_bn, name=captured.graph.name)
        return build(again, again.example_inputs, opts, eager=eager)

    def replan(args: tuple) -> Compiled:  # the same capture, its shapes at these sizes
        inputs = on_devices_of(args, example)
        return build(at_sizes(captured, inputs), inputs, opts, eager=eager)

    runnable = ExportedModule(model) if isinstance(model, torch.export.ExportedProgram) else model
    sizes = Sizes(compiled, runnable, example, replan=replan, buckets=opts.buckets)
    return attach(compiled, captured.graph.name, example, rebuild, bound=opts.cache_size, dynamic=opts.dynamic,
                  sizes=sizes)


__all__ = ["Compiled", "compile", "compile_captured", "compile_with"]
