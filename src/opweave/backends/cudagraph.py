"""Recording one run of a plan's CUDA lanes into a CUDA graph, and recovering when that fails.

The CUDA backend (:mod:`opweave.backends.cuda`) records once per input signature, on its capture stream: ``warmup``
plain runs of the plan (cuDNN/cuBLAS initialization, lazy allocations), then one :func:`checked_run` in CUDA's
sync-debug "error" mode, then :func:`record`, the capture itself, forked from and joined into the capture stream
(:class:`~opweave.backends.streams.CudaLanes`), with ``capture_error_mode="thread_local"`` (another thread's CUDA
calls, a server's other requests say, neither break the capture nor are refused because of it).

* An op that synchronizes the CPU with the GPU (``.item()``, ``.tolist()``, ``nonzero``, boolean masks, Python
  control flow on a tensor's value) cannot be recorded; the checked run finds it before capture and
  :class:`GraphCaptureError` names the op and the cause (the backend may then run the signature without a graph,
  ``capture_fallback="eager"``). ``torch.cuda.set_sync_debug_mode`` is process-wide: while the checked run lasts
  (one run of the plan, once per new signature), a synchronizing call made by *another* thread raises there too.
  Two checked runs never overlap (a module lock), so the mode is always restored. (The alternative, "warn" mode and
  Python's warning filters, would be just as process-wide and would misattribute another thread's sync to our op.)
* Anything that fails *during* capture is re-raised as :class:`GraphCaptureError` naming the op (never a fallback:
  the checked run passed, so the failure is not a sync and running the signature eagerly would hide it). The
  process is left usable: the other lanes are joined back where the capture allows it, the capture is ended, the
  graph memory pool is handed back to the allocator when PyTorch's ``capture_end`` raised before doing so, pending
  work is drained, and the caller's current stream is restored in a ``finally`` (``torch.cuda.graph``'s own exit
  skips the restore when ``capture_end`` raises, which is why the capture is driven here with ``capture_begin`` /
  ``capture_end``).

Everything CUDA is reached through the lanes' runtime (:mod:`opweave.backends.runtime`), so the fake runtime records
and replays the same way on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from opweave.backends.program import Lane, Step
from opweave.backends.streams import CudaLanes
from opweave.capture.runtime import Captured
from opweave.errors import CaptureError

_SYNC_HINT = ("synchronizes the CPU with the GPU (e.g. .item(), .tolist(), .cpu(), printing a tensor, nonzero or "
              "boolean-mask indexing, or Python control flow on a tensor's value), which a CUDA graph cannot record")
_SYNC_CHECK = threading.Lock()  # one checked run at a time in the process: set_sync_debug_mode is process-wide


class GraphCaptureError(CaptureError):
    """The plan could not be recorded into a CUDA graph; the message names the op and the cause."""


def checked_run(lanes: CudaLanes, steps: Iterable[tuple[Lane, Step]], captured: Captured, env: dict,
                origin) -> None:
    """One run of ``steps`` in CUDA's sync-debug "error" mode (process-wide: see the module docstring); a sync is
    raised as :class:`GraphCaptureError` naming the op."""
    runtime = lanes.runtime
    with _SYNC_CHECK:
        previous = runtime.get_sync_debug_mode()
        runtime.set_sync_debug_mode("error")
        try:
            lanes.issue(steps, origin, captured, env)
        except Exception as exc:
            if any("synchroniz" in str(e) for e in _chain(exc)):
                raise capture_error(captured, lanes.current_op, exc, sync=True) from exc
            raise
        finally:
            runtime.set_sync_debug_mode(previous)


def record(lanes: CudaLanes, steps: Iterable[tuple[Lane, Step]], captured: Captured, static_inputs,
           stream) -> tuple[Any, Any]:
    """Record one run of ``steps`` on ``stream`` (forked from and joined into it) into a new CUDA graph; the graph
    and its static output. Every failure path ends the capture, gives the memory pool back, restores the caller's
    current stream and raises :class:`GraphCaptureError` (module docstring)."""
    runtime = lanes.runtime
    device = stream.device
    caller = runtime.current_stream(device)
    graph = runtime.CUDAGraph()
    pool = runtime.graph_pool_handle()
    runtime.synchronize(device)  # as torch.cuda.graph: nothing of ours still pending when capture begins
    failure: BaseException | None = None
    where = output = None
    runtime.set_stream(stream)
    try:
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
            runtime.give_back_pool(pool, device)
            failure, where = exc, "beginning the capture"
        else:
            env = None
            try:
                env = runtime.launch(stream, captured.bind, static_inputs)
                lanes.issue(steps, stream, captured, env)
                output = captured.output(env)
            except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
                failure = exc
                lanes.join(stream, quietly=True)
            try:
                graph.capture_end()
            except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
                runtime.give_back_pool(pool, device)
                if failure is None:
                    failure, where = exc, "ending the capture"
            del env  # only now: the capture pool keeps these buffers for the graph, none reused mid-capture
    finally:
        runtime.set_stream(caller)
    if failure is None:
        return graph, output
    del graph, output
    _settle(runtime)
    if not isinstance(failure, Exception):
        raise failure
    op, lanes.current_op = lanes.current_op, None
    raise capture_error(captured, op, failure, where=where, during_capture=True) from failure


def capture_error(captured: Captured, op: str | None, exc: BaseException, *, sync: bool = False,
                  where: str | None = None, during_capture: bool = False) -> GraphCaptureError:
    """The one-line :class:`GraphCaptureError` for ``exc`` raised while op ``op`` ran (None: outside the ops), in
    the checked run before capture or ``during_capture``."""
    text = " ".join(str(e) for e in _chain(exc))
    if sync or any(s in text for s in ("capturing", "not permitted", "synchroniz")):
        cause = _SYNC_HINT
    else:
        first = str(exc).strip().splitlines()
        cause = f"failed: {type(exc).__name__}: {first[0] if first else ''}"
    if where is not None:
        place = where
    elif op in captured.graph.op:
        nodes = ", ".join(n.name for n in captured.nodes[op])
        place = f"op {op!r} ({captured.graph.op[op].target}; fx nodes {nodes})"
    else:
        place = "a step outside the ops (binding the inputs or building the output)"
    remedy = ("cudagraphs=False runs it without a graph (a failure during the capture is never run eagerly instead)"
              if during_capture else "pass capture_fallback='eager' or cudagraphs=False to run it without a graph")
    return GraphCaptureError(f"cannot record {captured.graph.name} into a CUDA graph: {place} {cause}; {remedy}")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _settle(runtime) -> None:
    """After a failed capture, let pending work finish so the error does not surface in an unrelated call."""
    try:
        runtime.synchronize()
    except RuntimeError:
        pass
