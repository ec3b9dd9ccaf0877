"""What is cached per input signature, and how: the one tensor signature and the one bounded cache.

* :func:`signature` — the key of a call's values: their pytree structure and, per leaf, a tensor's shape, dtype
  and device (plus, on request, its strides and, for chosen tensors, its address) or another value's ``repr``. The
  CUDA backend keys its captured graphs with it (:func:`opweave.backends.cuda.input_signature` says which parts
  count in which mode) and a fused segment its compiled graphs (:mod:`opweave.backends.segments`).
* :class:`BoundedCache` — a least-recently-used cache of at most ``maxsize`` entries (``cachetools.LRUCache``)
  that calls ``evicted(key, value)`` for every entry it drops. The CUDA backend's entries, the serving executors'
  compiled signatures and the segments' compiled graphs live in one.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cachetools
import torch
from torch.utils import _pytree as pytree


def signature(values: Sequence, *, strides: bool = False, devices: bool = True,
              by_address: Callable[[torch.Tensor], bool] | None = None, batch: bool = True) -> tuple[tuple, Sequence]:
    """The cache key of ``values`` and their leaves (``values`` itself when none is a list, tuple or dict: no
    pytree walk). The key is the pytree structure (None for flat values) and one part per leaf: a tensor's shape,
    dtype and (unless ``devices`` is False) device, plus its strides with ``strides``, plus its address where
    ``by_address(tensor)``; another value's ``("value", repr)``. ``batch=False`` leaves dimension 0 of every tensor
    out (its size and stride): the key of what takes any batch."""
    leaves: Sequence
    head: str | None
    if any(isinstance(v, (list, tuple, dict)) for v in values):
        leaves, spec = pytree.tree_flatten(values)
        head = str(spec)
    else:
        leaves, head = values, None
    return (head, *(_leaf(x, strides, devices, by_address, batch) for x in leaves)), leaves


def key_of(args: Sequence, *, any_batch: bool = False, strides: bool = False) -> tuple:
    """The signature of a compiled model's inputs ``args`` as it keys them: :func:`signature` without the tensors'
    devices (the backends move inputs to theirs); with ``any_batch``, without their dimension 0; with ``strides``,
    with the tensors' strides (for what was built for one layout)."""
    return signature(args, devices=False, strides=strides, batch=not any_batch)[0]


def _leaf(x: Any, strides: bool, devices: bool, by_address: Callable[[torch.Tensor], bool] | None,
          batch: bool = True) -> tuple:
    if not isinstance(x, torch.Tensor):
        return ("value", repr(x))
    shape = x.shape if batch or x.dim() == 0 else x.shape[1:]
    key: tuple = (shape, x.dtype, x.device) if devices else (shape, x.dtype)
    if strides:
        key += (x.stride() if batch or x.dim() == 0 else x.stride()[1:],)
    if by_address is not None and by_address(x):
        key += (x.data_ptr(),)
    return key


class BoundedCache(cachetools.LRUCache):
    """An LRU cache of at most ``maxsize`` entries that calls ``evicted(key, value)`` for each entry it drops to
    make room (before the new entry is stored; ``clear()`` calls nothing). Reading an entry (``cache[key]``,
    ``get``) makes it the most recently used; ``key in cache`` does not. Iteration follows insertion order, not
    recency (``cachetools``). A bound method as ``evicted`` is held weakly, so that the cache of an object does not
    keep it alive: a backend dropped by its caller frees its threads, streams and graphs at once, not at the next
    garbage collection."""

    def __init__(self, maxsize: int, evicted: Callable[[Any, Any], None] | None = None):
        super().__init__(maxsize)
        self._evicted: Callable[[], Callable[[Any, Any], None] | None]
        if inspect.ismethod(evicted):
            self._evicted = weakref.WeakMethod(evicted)
        else:
            self._evicted = lambda: evicted

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        evicted = self._evicted()
        if evicted is not None:
            evicted(key, value)
        return key, value
