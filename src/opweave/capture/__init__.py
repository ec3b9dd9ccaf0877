"""Capture: a PyTorch model and example inputs become an :class:`~opweave.ir.OpGraph` plus a runnable
:class:`Captured`.

* :mod:`.source` — :func:`load`: a zoo name, a ``.pt2`` file (:func:`load_program`) or a TorchScript file
  (:func:`load_torchscript`) built, captured and coarsened, the one way from a model's name to a :class:`Captured`;
* :mod:`.trace` — :func:`capture`: eager run, trace (fx, else torch.export), verify against eager, shapes;
* :mod:`.functionalize` — in-place ops rewritten out of place where that keeps eager's meaning;
* :mod:`.partition` — fx nodes grouped into ops, edges between them, the OpGraph;
* :mod:`.coarsen` — :func:`coarsen`: ops merged with their epilogues (BatchNorm folded), the papers' operators;
* :mod:`.opinfo` — per-node facts: target name, category, FLOPs, bytes, trivial or not;
* :mod:`.runtime` — :class:`Captured`: bind inputs, run one op, rebuild the output.
"""

from opweave.capture.coarsen import coarsen
from opweave.capture.functionalize import apply_on_clone
from opweave.capture.runtime import Captured
from opweave.capture.source import Loaded, load, load_program, load_torchscript
from opweave.capture.trace import capture
from opweave.errors import CaptureError

__all__ = ["CaptureError", "Captured", "Loaded", "apply_on_clone", "capture", "coarsen", "load", "load_program",
           "load_torchscript"]
