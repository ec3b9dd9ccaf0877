"""Where ``opweave.compile(..., mode="max-autotune")`` keeps what it chose, per model, device and machine.

A JSON file, ``autotune.json`` in ``$OPWEAVE_CACHE_DIR`` (default ``~/.cache/opweave``), maps a key to the chosen
candidate (:class:`opweave.pipeline.autotune.Candidate`: scheduler, stream cap, segment compiler, graph, scheduler
options), the costs it was planned with (so that the same plan is rebuilt) and what every candidate measured. The key
covers what the choice depends on: the captured graph (its name, ops and their targets, and the granularity), the input
shapes and dtypes, the device (the GPU's name for CUDA), the machine (processor and the cores this process may use), the
mode and every option's value (CUDA Graphs on or off, the threads, ...), the versions of torch, CUDA and ONNX
Runtime, and :data:`SEARCH`, the version of the search's candidate lists (a choice made from another list is made
again: it may name a candidate the list no longer has, or a label that now means another one). A file that cannot
be read is ignored (and rewritten on the next choice); writes go through a temporary file, so a reader never sees
half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

SEARCH = 4  # raised whenever a device's candidate list changes (2: CUDA's segments compiled by Inductor; 3: the CPU
# list without Inductor where ONNX Runtime is installed; 4: ONNX Runtime in one lane below LANE_CORES threads)


def cache_path() -> Path:
    return Path(os.environ.get("OPWEAVE_CACHE_DIR") or Path.home() / ".cache" / "opweave") / "autotune.json"


def machine() -> str:
    """The processor's model name and the cores this process may use."""
    from opweave.cores import cores

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name} x{cores()}"


def key(captured: Any, inputs: tuple[Any, ...], options: Any) -> str:
    """What a choice is valid for (module docstring), as a short hash: the graph, the inputs, the machine, the
    versions and every setting of ``options`` (:class:`~opweave.pipeline.options.Options`: the mode, CUDA Graphs,
    the threads, ...) but the objects that name no setting (costs, a profile's path: the search plans on its own)."""
    from opweave.pipeline.options import OPTIONS

    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    device = options.device
    settings = {name: getattr(options, name) for name in OPTIONS if name not in ("costs", "profile", "runtime")}
    parts = {
        "graph": captured.graph.name,
        "ops": [(op.id, op.target) for op in captured.graph.ops],
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in inputs],
        "machine": machine(),
        "device": device if device == "cpu" else _gpu_name(options.runtime),
        "mode": options.mode,
        "settings": settings,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "onnxruntime": ort,
        "search": SEARCH,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _gpu_name(runtime: Any) -> str:
    from opweave.backends.runtime import CUDA

    return (runtime or CUDA).device_name()


def load(entry_key: str) -> dict[str, Any] | None:
    """The choice stored under ``entry_key``, or None."""
    try:
        found: dict[str, Any] | None = json.loads(cache_path().read_text()).get(entry_key)
        return found
    except (OSError, ValueError, AttributeError):
        return None


def save(entry_key: str, choice: dict[str, Any]) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[entry_key] = choice
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1) + "\n")
    scratch.replace(path)
