"""Stand-ins for the hardware, for tests and benchmarks that check opweave's logic where the device is not there, as
``torch.testing`` holds PyTorch's fakes: none of the product imports this package.

* :class:`~opweave.testing.fakecuda.FakeCuda` — a CUDA runtime on the CPU (deferred kernels per stream, run in a
  seeded random order the events allow, block reuse after a release, graph capture and replay), given as the
  ``runtime`` option: ``opweave.compile(model, inputs, runtime=FakeCuda())`` runs the whole CUDA path on a machine
  without a GPU, and a missing wait or an early free gives a wrong output there.
"""

from opweave.testing.fakecuda import FakeCuda

__all__ = ["FakeCuda"]
