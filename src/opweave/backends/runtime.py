"""The one object through which the CUDA backend reaches CUDA: streams, events, graph capture and the rest.

The CUDA backend (:mod:`opweave.backends.cuda`), its lanes and stream pool (:mod:`opweave.backends.streams`), the
capture code (:mod:`opweave.backends.cudagraph`) and the CUDA serving executor take a *runtime* and call nothing in
``torch.cuda`` themselves. Two runtimes meet the :class:`Runtime` protocol:

* :data:`CUDA` (:class:`CudaRuntime`), the default: each method is the ``torch.cuda`` call of the same name (or
  nothing, where CUDA itself does the work), so a GPU runs exactly what it ran before.
* :class:`opweave.testing.fakecuda.FakeCuda`: CPU tensors stand in for device memory, and every stream defers its
  work until something must observe it, which it then runs in a seeded random order that respects only the
  streams' FIFO order and the recorded events (missing waits and early frees give wrong outputs there). This is
  how the CUDA backend is tested on machines without a GPU, as ``torch.distributed``'s fake process group tests
  collective code without a network: the logic runs for real against a stand-in.

What the backend asks of a runtime beyond ``torch.cuda``'s own names: :meth:`~Runtime.launch` (the device work of a
host function, issued on a stream: every op, input copy and output clone goes through it), :meth:`~Runtime.dropped`
(the host dropped device tensors at this point of a lane: a liveness release), and ``pools`` (the stream pools of
:func:`opweave.backends.streams.stream_pool`, one per device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch


class Runtime(Protocol):
    """What the CUDA backend calls (see the module docstring); ``torch.cuda``'s names and meanings unless said."""

    pools: dict[int, Any]
    pools_lock: threading.Lock

    @property
    def device(self) -> torch.device:
        """The device the backend runs on: the current CUDA device (the CPU for the fake)."""

    def is_available(self) -> bool: ...

    def device_name(self) -> str: ...

    def Stream(self, device=None, priority: int = 0) -> Any: ...  # noqa: N802 - torch.cuda's name

    def Event(self) -> Any: ...  # noqa: N802

    def CUDAGraph(self) -> Any: ...  # noqa: N802

    def current_stream(self, device=None) -> Any: ...

    def set_stream(self, stream) -> None: ...

    def stream(self, stream) -> Any:
        """A context manager making ``stream`` current (None: no change)."""

    def synchronize(self, device=None) -> None: ...

    def launch(self, stream, fn: Callable, *args) -> Any:
        """``fn(*args)``, its device work issued on ``stream``, which the caller made current."""

    def dropped(self, values: Iterable[Any]) -> None:
        """The host just dropped ``values`` (device tensors among them), at this point of the lanes' issue."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None: ...

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def graph_pool_handle(self) -> Any: ...

    def give_back_pool(self, pool, device: torch.device) -> None:
        """Release the memory pool of a capture that did not end cleanly (see :class:`CudaRuntime`)."""

    def get_sync_debug_mode(self) -> int: ...

    def set_sync_debug_mode(self, mode: int | str) -> None: ...

    def is_current_stream_capturing(self) -> bool: ...

    def memory_allocated(self, device=None) -> int: ...

    def max_memory_allocated(self, device=None) -> int: ...

    def reset_peak_memory_stats(self, device=None) -> None: ...


class CudaRuntime:
    """:class:`Runtime` on ``torch.cuda``: every method is the call of the same name there."""

    name = "cuda"

    def __init__(self) -> None:
        self.pools: dict[int, Any] = {}
        self.pools_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def Stream(self, device=None, priority: int = 0):  # noqa: N802 - torch.cuda's name
        return torch.cuda.Stream(device, priority)

    def Event(self):  # noqa: N802
        return torch.cuda.Event()

    def CUDAGraph(self):  # noqa: N802
        return torch.cuda.CUDAGraph()

    def current_stream(self, device=None):
        return torch.cuda.current_stream(device)

    def set_stream(self, stream) -> None:
        torch.cuda.set_stream(stream)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self, device=None) -> None:
        torch.cuda.synchronize(device)

    @staticmethod
    def launch(stream, fn: Callable, *args) -> Any:
        return fn(*args)  # PyTorch issues every kernel on the current stream, which ``stream`` is

    @staticmethod
    def dropped(values) -> None:
        """Nothing to do: the caching allocator took the blocks back when their last reference went."""

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    @staticmethod
    def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        return x.to(device, non_blocking=x.is_pinned())

    def graph_pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def give_back_pool(self, pool, device: torch.device) -> None:
        """Stop routing allocations to a capture's private pool and release it, for a capture that did not end
        cleanly: PyTorch's ``capture_end`` raises before doing either when ``cudaStreamEndCapture`` fails, and the
        graph's destructor releases the pool only after a capture that ended. If stopping is refused,
        ``capture_end`` got past that point and the graph releases the pool itself: releasing it here too would do
        it twice. (The binding was renamed in torch 2.8.)"""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
            torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is None or release is None:
            return
        try:
            end(device.index, pool)
        except Exception:  # noqa: BLE001 - not capturing to that pool any more: see the docstring
            return
        release(device.index, pool)

    def get_sync_debug_mode(self) -> int:
        return torch.cuda.get_sync_debug_mode()

    def set_sync_debug_mode(self, mode: int | str) -> None:
        torch.cuda.set_sync_debug_mode(mode)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def memory_allocated(self, device=None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device=None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def __repr__(self) -> str:
        return "CudaRuntime()"


CUDA = CudaRuntime()
"""The runtime of every CUDA backend that is given none: ``torch.cuda`` itself."""
