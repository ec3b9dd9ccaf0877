"""Stand-ins for the hardware, for tests and benchmarks that check opweave's logic where the device is not there, as
``torch.testing`` holds PyTorch's fakes: none of the product imports this package.

* :class:`~opweave.testing.fakecuda.FakeCuda` — a CUDA runtime on the CPU (deferred kernels per stream, run in a
  seeded random order the events allow, block reuse after a release, graph capture and replay), given as the
  ``runtime`` option: ``opweave.compile(model, inputs, runtime=FakeCuda())`` runs the whole CUDA path on a machine
  without a GPU, and a missing wait or an early free gives a wrong output there.
* :class:`~opweave.testing.serving.BackgroundServer` — a server on a thread of this process, on 127.0.0.1 and
  ephemeral ports, put together from the server's own pieces (``from opweave.testing.serving import
  BackgroundServer``: it needs the ``serve`` extra, which this package does not import);
  :mod:`opweave.testing.loads`, what the serving tests and benchmarks measure of a load (a model's latency alone in
  simulation, whether a rate was sustained).
"""

from opweave.testing.fakecuda import FakeCuda

__all__ = ["FakeCuda"]
