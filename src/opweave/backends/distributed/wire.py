"""What travels between processes: pickled rank parts and control messages, and values as byte buffers.

**Pickling** (:func:`dumps`, :func:`loads`): the standard pickler (tensors are copied into the bytes, never moved
to shared memory as ``torch.multiprocessing``'s pickler would do with the caller's tensors), plus ATen operator
overloads (``torch.ops.aten.linear.default``, the targets of ``torch.export`` graphs), which do not pickle by
themselves: they travel as their qualified name.

**Layouts.** A value crossing devices has a layout known when the model was captured: ShapeProp's ``tensor_meta``
of its fx node (a tensor, or a tuple/list/dict of them, non-tensor leaves kept as constants) or, for a node whose
value holds no tensor, its ``type`` when that is ``int``, ``float`` or ``bool`` (sent as one 8-byte number). So a
receiver allocates its buffers without asking the sender for shapes. Every tensor travels as the ``uint8`` view of
its contiguous bytes (any dtype, one code path for gloo and NCCL); zero-byte tensors do not travel at all.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from opweave.errors import PlanError

# ---- pickling -----------------------------------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj.overloadpacket.__name__, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _overload, (obj._qualified_op_name.split("::")[0], obj.__name__, None)
        return NotImplemented


def _overload(namespace: str, name: str, overload: str | None):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


# ---- layouts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class ScalarLayout:
    kind: type  # int, float or bool


@dataclass(frozen=True)
class Constant:
    value: Any


@dataclass(frozen=True)
class Sequence:
    kind: type  # tuple, list, a namedtuple or a structseq
    items: tuple


@dataclass(frozen=True)
class Mapping:
    items: tuple  # ((key, layout), ...)


_SCALAR_DTYPE = {int: torch.int64, bool: torch.int64, float: torch.float64}


def layout_of(node: fx.Node, op: str) -> Any:
    """The layout of ``node``'s value (see the module docstring); :class:`PlanError` naming ``op`` and the node when
    it cannot cross devices."""
    if "tensor_meta" in node.meta:
        return _layout(node.meta["tensor_meta"])
    kind = node.meta.get("type")
    if kind in _SCALAR_DTYPE:
        return ScalarLayout(kind)
    raise PlanError(f"op {op!r}: the value of fx node {node.name!r} ({getattr(kind, '__name__', kind)}) is needed on "
                    "another device, but only tensors, containers of tensors and int/float/bool can be sent; "
                    "place its readers on the same device")


def _layout(meta: Any) -> Any:
    if hasattr(meta, "shape") and hasattr(meta, "dtype") and hasattr(meta, "stride"):  # ShapeProp's TensorMetadata
        return TensorLayout(tuple(meta.shape), meta.dtype)
    if isinstance(meta, dict):
        return Mapping(tuple((k, _layout(v)) for k, v in meta.items()))
    if isinstance(meta, (tuple, list)):
        return Sequence(type(meta), tuple(_layout(v) for v in meta))
    return Constant(meta)


def _leaves(layout: Any):
    if isinstance(layout, Sequence):
        for item in layout.items:
            yield from _leaves(item)
    elif isinstance(layout, Mapping):
        for _, item in layout.items:
            yield from _leaves(item)
    else:
        yield layout


def part_sizes(layouts) -> tuple[int, ...]:
    """Bytes of each buffer that values of these layouts travel as, in order."""
    sizes = []
    for layout in layouts:
        for leaf in _leaves(layout):
            if isinstance(leaf, TensorLayout) and leaf.nbytes:
                sizes.append(leaf.nbytes)
            elif isinstance(leaf, ScalarLayout):
                sizes.append(8)
    return tuple(sizes)


def pack(value: Any, layout: Any, where: str, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The byte buffers ``value`` travels as (``where`` names it in errors; scalars are put on ``device``)."""
    parts: list[torch.Tensor] = []
    _pack(value, layout, where, device, parts)
    return parts


def _pack(value: Any, layout: Any, where: str, device, parts: list[torch.Tensor]) -> None:
    if isinstance(layout, TensorLayout):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != layout.shape or value.dtype != layout.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"{where} is {got}, but it was captured as {layout.shape} {layout.dtype}")
        if layout.nbytes:
            parts.append(value.detach().contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(layout, ScalarLayout):
        parts.append(torch.tensor([value], dtype=_SCALAR_DTYPE[layout.kind], device=device).view(torch.uint8))
    elif isinstance(layout, Sequence):
        for v, item in zip(value, layout.items, strict=True):
            _pack(v, item, where, device, parts)
    elif isinstance(layout, Mapping):
        for k, item in layout.items:
            _pack(value[k], item, where, device, parts)


def unpack(parts, layout: Any, device: torch.device | str = "cpu") -> Any:
    """The value rebuilt from an iterator over its received byte buffers."""
    if isinstance(layout, TensorLayout):
        if not layout.nbytes:
            return torch.empty(layout.shape, dtype=layout.dtype, device=device)
        return next(parts).view(layout.dtype).reshape(layout.shape)
    if isinstance(layout, ScalarLayout):
        return layout.kind(next(parts).view(_SCALAR_DTYPE[layout.kind]).cpu()[0].item())
    if isinstance(layout, Sequence):
        return _rebuild(layout.kind, [unpack(parts, item, device) for item in layout.items])
    if isinstance(layout, Mapping):
        return {k: unpack(parts, item, device) for k, item in layout.items}
    return layout.value


def stand_in(layout: Any) -> Any:
    """A value of ``layout`` with every tensor on the ``meta`` device (no memory): what a rank binds for a model
    input it does not read."""
    if isinstance(layout, TensorLayout):
        return torch.empty(layout.shape, dtype=layout.dtype, device="meta")
    if isinstance(layout, ScalarLayout):
        return layout.kind()
    if isinstance(layout, Sequence):
        return _rebuild(layout.kind, [stand_in(item) for item in layout.items])
    if isinstance(layout, Mapping):
        return {k: stand_in(item) for k, item in layout.items}
    return layout.value


def _rebuild(kind: type, items: list) -> Any:
    if kind in (tuple, list):
        return kind(items)
    if hasattr(kind, "_fields"):  # a namedtuple
        return kind(*items)
    return kind(items)  # a structseq (torch.return_types.*)
