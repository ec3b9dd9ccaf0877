"""Profiles on disk: what was measured (per-op latency, kernels, resources, utilization, category) and for what.

A profile is keyed by model name, input shapes, dtype, device name and torch version; :meth:`Profile.load` with an
expected key, and :func:`load_for`, refuse a profile whose key does not match, so a stale profile is never reused.
The JSON format is ``opweave.profile/1``: the :class:`Profile` fields as they are.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from opweave.costs.model import Costs, file_fields, from_graph
from opweave.errors import ProfileError
from opweave.ir.graph import OpGraph

FORMAT = "opweave.profile/1"
KEY_FIELDS = ("model", "input_shapes", "dtype", "device", "torch")


class ProfileKeyError(ProfileError):
    """A profile measured for another model, input, dtype, device or torch version."""


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}"


def profile_key(model: str, inputs: Sequence, device: str, dtype: torch.dtype | str | None = None) -> dict:
    """What a profile is valid for. ``dtype`` defaults to the first floating-point input's (else the first's)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if dtype is None:
        floating = [x for x in tensors if x.is_floating_point()] or tensors
        dtype = floating[0].dtype if floating else "none"
    return {"model": model,
            "input_shapes": [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in inputs],
            "dtype": str(dtype).removeprefix("torch."),
            "device": device_name(device),
            "torch": torch.__version__}


def model_dtype(captured, inputs: Sequence) -> torch.dtype | None:
    """The parameters' floating dtype (fp16 model with int64 token ids is an fp16 profile)."""
    for p in captured.gm.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


# ---- the profile ----------------------------------------------------------------------------------------------------


@dataclass
class Profile:
    key: dict
    latency_ms: dict[str, float]
    kernels: dict[str, list[dict]] = field(default_factory=dict)
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    utilization: dict[str, float] = field(default_factory=dict)
    category: dict[str, str] = field(default_factory=dict)
    category_disagreements: list[dict] = field(default_factory=list)
    device_properties: dict = field(default_factory=dict)
    repeats: int = 0
    warmup: int = 0
    threads: int | None = None  # CPU: the intra-op threads each op was timed with

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        return cls(**file_fields(cls, data, FORMAT, "profile", ProfileError))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> Profile:
        """Read a profile; with ``expect`` (see :func:`profile_key`), refuse one measured for something else."""
        try:
            prof = cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as exc:  # no such file, a directory, no permission: bad input, not a bug
            raise ProfileError(f"cannot read profile {str(path)!r}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if expect is not None:
            prof.check_key(expect, source=str(path))
        return prof

    def check_key(self, expect: dict, source: str = "profile") -> None:
        keys = [*KEY_FIELDS, *sorted((set(expect) | set(self.key)) - set(KEY_FIELDS))]  # the most telling first
        wrong = [k for k in keys if self.key.get(k) != expect.get(k)]
        if wrong:
            k = wrong[0]
            raise ProfileKeyError(f"{source} was measured for {k} {self.key.get(k)!r}, not {expect.get(k)!r}; "
                                  "profile again (`opweave profile`)")

    def apply(self, graph: OpGraph) -> OpGraph:
        """A copy of ``graph`` whose ops carry this profile's measurements (latency, and utilization, resources and
        category where measured); the profile must have measured exactly the graph's ops (a profile of the fine
        graph does not fit the coarsened one, whose op ids are a subset, nor the other way round)."""
        missing = [o for o in graph.ids if o not in self.latency_ms]
        extra = [o for o in self.latency_ms if o not in graph.op]
        if missing or extra:
            what = f"no latency for op {missing[0]!r}" if missing else f"a latency for op {extra[0]!r}, not an op"
            raise ProfileKeyError(f"profile has {what} of graph {graph.name!r} ({len(self.latency_ms)} ops measured, "
                                  f"{len(graph)} in the graph): it was measured for another graph, or for the other "
                                  "granularity (profile and compile both coarsened or both not: --coarsen/--no-coarsen,"
                                  " coarsen=)")
        ops = [replace(o, latency_ms=self.latency_ms[o.id], utilization=self.utilization.get(o.id, o.utilization),
                       resources=self.resources.get(o.id, o.resources), category=self.category.get(o.id, o.category))
               for o in graph.ops]
        return OpGraph(ops, [replace(e) for e in graph.edges], graph.name)

    def costs(self, graph: OpGraph, model: str = "ideal") -> Costs:
        """Costs for ``graph`` from this profile (see :meth:`apply`)."""
        return from_graph(self.apply(graph), model=model, source="profile")


def load_for(path: str | Path, captured, inputs: Sequence, device: str) -> Profile:
    """The profile at ``path``, refused unless it was measured for these input shapes and dtype, this device and
    this torch (the model is identified by its op ids, which :meth:`Profile.apply` checks)."""
    prof = Profile.load(path)
    expect = profile_key(prof.key.get("model", ""), tuple(inputs), device, model_dtype(captured, inputs))
    prof.check_key(expect, source=str(path))
    return prof


