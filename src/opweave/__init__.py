"""opweave: inter-operator parallel DNN inference on GPUs.

Capture a model into an :class:`~opweave.ir.OpGraph`, schedule its independent operators onto streams and devices
with one of the papers' schedulers, lower the schedule to a race-checked :class:`~opweave.plan.LaunchPlan`, and run
it (CPU threads, CUDA streams recorded into a CUDA Graph) or simulate it.

>>> import torch, opweave
>>> model, inputs = opweave.zoo.create("squeezenet")
>>> fast = opweave.compile(model, inputs, scheduler="lios", device="cpu")
>>> torch.allclose(fast(*inputs), model(*inputs), atol=1e-5)
True

Submodules that import torch load lazily, so graph-only work (``opweave.ir``, schedulers, the simulator) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from opweave import schedulers
from opweave.errors import OpweaveError
from opweave.ir import Edge, GraphError, Op, OpGraph

__version__ = "0.1.0"
__all__ = ["Compiled", "Edge", "GraphError", "Op", "OpGraph", "OpweaveError", "capture", "compile", "compile_captured",
           "examples", "generate", "llm", "schedulers", "synth", "zoo"]

_LAZY = {"compile": ("opweave.api", "compile"), "compile_captured": ("opweave.api", "compile_captured"),
         "Compiled": ("opweave.pipeline.compiled", "Compiled"), "capture": ("opweave.capture", None),
         "generate": ("opweave.llm.decoding", "generate"), "llm": ("opweave.llm", None),
         "zoo": ("opweave.zoo", None), "examples": ("opweave.ir.examples", None), "synth": ("opweave.ir.synth", None)}

if TYPE_CHECKING:
    from opweave import capture, llm, zoo
    from opweave.api import compile, compile_captured
    from opweave.ir import examples, synth
    from opweave.llm.decoding import generate
    from opweave.pipeline.compiled import Compiled


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'opweave' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
