"""Capture: a PyTorch model and example inputs become an :class:`~opweave.ir.OpGraph` plus a runnable
:class:`Captured`.

* :mod:`.trace` — :func:`capture`: eager run, trace (fx, else torch.export), verify against eager, shapes;
  :func:`load_program` reads a ``.pt2`` file;
* :mod:`.functionalize` — in-place ops rewritten out of place where that keeps eager's meaning;
* :mod:`.partition` — fx nodes grouped into ops, edges between them, the OpGraph;
* :mod:`.coarsen` — :func:`coarsen`: ops merged with their epilogues (BatchNorm folded), the papers' operators;
* :mod:`.opinfo` — per-node facts: target name, category, FLOPs, bytes, trivial or not;
* :mod:`.runtime` — :class:`Captured`: bind inputs, run one op, rebuild the output.
"""

from opweave.capture.coarsen import coarsen
from opweave.capture.functionalize import apply_on_clone
from opweave.capture.runtime import Captured
from opweave.capture.trace import capture, load_program
from opweave.errors import CaptureError

__all__ = ["CaptureError", "Captured", "apply_on_clone", "capture", "coarsen", "load_program"]
