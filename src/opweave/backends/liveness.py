"""When may a backend free a buffer that several streams read? The buffers of a run, found before it runs, and
where the plan's memory pass (:mod:`opweave.plan.lifetimes`) frees them, as the steps a backend walks.

The CUDA caching allocator hands a freed block back to the pool of the stream that *allocated* it, and gives it to
the next allocation on that same stream at once, without waiting for other streams. So freeing a
buffer (dropping its last reference on the host) is safe at a point of the allocating stream's lane only when that
point is ordered — through the lane's own FIFO order and the plan's record/wait joins — after the launch of every op
that uses the buffer (reads it, writes it in place, or holds a view of it). Anything issued later to the allocating
stream then starts after those uses have finished, and it is the only work that can reuse the block.

:func:`release_points` finds, for every buffer, the earliest such point on its allocating lane
(:func:`opweave.plan.lifetimes.release_points`, as step indices of a :class:`~opweave.backends.program.Program`: a
program's step ``i`` is the semantics' position ``i + 1``); a buffer with no such point is kept until the final join
(the caller's environment is dropped after the call, or the capture ends). Because a wait is always issued after the
record it refers to, every use ordered before a release point was also issued (on the host) before it, so a
host-side interpreter can apply the releases in issue order.

**Which buffers.** :func:`static_buffers` finds them before anything runs on the device: the model runs once, op
by op in its graph's topological order, on PyTorch's fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``:
shapes, dtypes, strides and storage identity, no memory and no kernels), which is exact for views and in-place ops
kept in place, as the real run would make them in any order the edges allow. :func:`storage_buffers` groups the
environment of such a run (or of a real run that kept every intermediate) by the storage its entries share (views
and in-place results included); each group's allocating lane is the lane of the first op that held it, its size the
storage's bytes. Groups that are model inputs, parameters or anything computed in ``bind``, groups the output
returns, and groups allocated on several lanes are left out (kept to the end). Only the grouping depends on the
program: a :class:`FakeRun` keeps the run, and a CUDA build makes one for all its plans (the memory pass of each,
:func:`opweave.pipeline.memory_pass.memory_pass`, then the backend's release plan for the example inputs).
:func:`release_keys` turns validated release points (:func:`opweave.plan.lifetimes.validate_releases`) into
environment keys, and :func:`steps_with_releases` puts them on the steps a
:class:`~opweave.backends.program.Walker` runs (the CUDA backend does; see its docstring).

Complexity: that of :mod:`opweave.plan.lifetimes`; :func:`static_buffers` one run of the model on fake tensors
(none when given a :class:`FakeRun` that has run) and one pass over its environment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import signature
from opweave.backends.program import Lane, Program, Step
from opweave.capture.runtime import Captured, module_tensors
from opweave.plan import lifetimes
from opweave.plan.lifetimes import Buffer

__all__ = ["Buffer", "FakeRun", "launch_positions", "release_keys", "release_points", "static_buffers",
           "steps_with_releases", "storage_buffers"]


def launch_positions(program: Program) -> dict[str, tuple[Lane, int]]:
    """Lane and step index of every launched op."""
    return {step.op: (lane, i) for lane, steps in program.lanes.items()
            for i, step in enumerate(steps) if step.kind == "launch"}


def steps_with_releases(program: Program, releases: dict[tuple[Lane, int], list[str]]) -> list[tuple[Lane, Step]]:
    """The program in issue order, each step carrying in ``release`` what to drop right after it: how a
    :class:`~opweave.backends.program.Walker` applies :func:`release_points` (or the same mapping with buffer
    names replaced by environment keys, :func:`release_keys`)."""
    position = dict.fromkeys(program.lanes, 0)
    out = []
    for lane, step in program.issue_order:
        index = position[lane]
        position[lane] = index + 1
        keys = releases.get((lane, index))
        out.append((lane, replace(step, release=tuple(keys)) if keys else step))
    return out


def release_points(program: Program, buffers: Iterable[Buffer]) -> dict[tuple[Lane, int], list[str]]:
    """Earliest safe release of every buffer: ``{(lane, step index): [buffer names]}``, to apply right after that
    step of that lane (:func:`opweave.plan.lifetimes.release_points`). Buffers that appear in no entry must be kept
    until the final join.

    Tiny example: lane A launches ``x`` then records signal 0; lane B waits on it and launches ``y``; lane A then
    waits for signal 1 raised by B after ``y``. A buffer allocated on A and read by ``y`` is released right after
    A's wait for signal 1 (not after ``x``, and not at all if A never waits for B).
    """
    return _steps(lifetimes.release_points(program.plan, buffers))


def release_keys(program: Program, buffers: list[Buffer],
                 releases: dict | None = None) -> dict[tuple[Lane, int], list[str]]:
    """After which step of which lane each environment key may be dropped: ``releases`` (the plan's points, by
    default :func:`opweave.plan.lifetimes.release_points`), proven safe first by
    :func:`opweave.plan.lifetimes.validate_releases` (a :class:`~opweave.errors.PlanError` names the buffer
    otherwise), each buffer's name replaced by its keys."""
    if releases is None:
        releases = lifetimes.release_points(program.plan, buffers)
    lifetimes.validate_releases(program.plan, buffers, releases)
    keys = {b.name: b.keys for b in buffers}
    return {at: [k for name in names for k in keys[name]] for at, names in _steps(releases).items()}


def _steps(releases: dict) -> dict[tuple[Lane, int], list[str]]:
    """Plan points (1-based positions) as program steps (0-based)."""
    return {(lane, position - 1): names for (lane, position), names in releases.items()}


class FakeRun:
    """``captured`` run once on fake tensors for ``args`` (module docstring), when first asked for, and kept: what
    :func:`static_buffers` groups for any program of it. The storages, their sizes and users do not depend on the
    program; only what :func:`storage_buffers` derives from it (each group's allocating lane, which groups several
    lanes allocate) does, so one run serves every plan of one build and the backend's first input signature. A run
    that failed raises its error again when asked again, without running again."""

    def __init__(self, captured: Captured, args: tuple):
        self.captured, self.args = captured, args
        self._result: tuple[dict, list] | Exception | None = None

    def serves(self, captured: Captured, args: tuple) -> bool:
        """Whether this run stands for one of ``captured`` on ``args``: the same module, and inputs of the same
        structure, shapes, dtypes, devices and strides, and equal other values (their cache key with strides,
        :func:`opweave.backends.cache.signature`: whether an op returns a view or a copy, and the layout of a
        convolution's output, can depend on them; a model moved to another device is another module)."""
        same_inputs = signature(args, strides=True)[0] == signature(self.args, strides=True)[0]
        return captured.gm is self.captured.gm and same_inputs

    def result(self) -> tuple[dict, list]:
        """The environment of the run (every value it computed, as fake tensors) and the module's parameters and
        buffers as fake tensors of the same run (:func:`storage_buffers`' ``external``)."""
        if self._result is None:
            try:
                self._result = _fake_run(self.captured, self.args)
            except Exception as exc:  # noqa: BLE001 - kept, and raised to every caller
                self._result = exc
        if isinstance(self._result, Exception):
            raise self._result
        return self._result


def _fake_run(captured: Captured, args: tuple) -> tuple[dict, list]:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else mode.from_tensor(t)

    with torch.no_grad(), mode:
        env = captured.bind(pytree.tree_map_only(torch.Tensor, fake, args))
        env = {k: pytree.tree_map_only(torch.Tensor, fake, v) for k, v in env.items()}
        external = [fake(t) for t in module_tensors(captured.gm)]
        for op in captured.graph.topo_order:
            Captured.run_op(captured, op, env)  # a segmented model's ops node by node, as compiled
    return env, external


def static_buffers(captured: Captured, args: tuple, program: Program, run: FakeRun | None = None) -> list[Buffer]:
    """The buffers a run of ``program`` on ``args`` allocates (:func:`storage_buffers`), found by running the model
    on fake tensors (module docstring): ``run``, when given, is that run, made before for this model and inputs of
    ``args``' signature (a build's memory pass and its backend share one); else one is made here. Raises what the
    model raises when it cannot run on fake tensors (an op without a fake implementation, Python control flow on a
    tensor's value): the caller then learns them from a real run. A ``run`` that does not serve ``captured`` on
    ``args`` (:meth:`FakeRun.serves`) is not used."""
    if run is None or not run.serves(captured, args):
        run = FakeRun(captured, args)
    env, external = run.result()
    return storage_buffers(captured, env, program, external)


def storage_buffers(captured: Captured, env: dict, program: Program,
                    external: Iterable[torch.Tensor] = ()) -> list[Buffer]:
    """Group the environment of a run that kept every intermediate (on fake tensors, :func:`static_buffers`, or
    real ones) by shared storage (a view, an in-place result and its base are one group) into :class:`Buffer` s for
    the memory pass, each with the bytes of its storages, in the order of the program's launches (each group named
    by its first entry in that order), however the run was ordered.

    Only groups computed by ops are returned: a group that holds a model input, a parameter or anything computed
    in ``bind``, a group that shares storage with one of ``external`` (the module's parameters and buffers, which an
    op may return a view of), a group the output returns, and a group allocated by ops on several lanes are left out
    (kept).
    """
    launches = [(lane, step.op) for lane, step in program.issue_order if step.kind == "launch"]
    lane_of = {op: lane for lane, op in launches}
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    readers = captured.readers()
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    returned = {n.name for n in output.all_input_nodes}
    rank = {op: i for i, (_, op) in enumerate(launches)}

    parent: dict[object, object] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    outside = {s for s in map(_storage, external) if s is not None}
    storages_of: dict[str, list[tuple]] = {}
    # the ops' entries in the program's issue order, whatever order the run went in: it orders (and names) the groups
    for key in sorted(env, key=lambda k: rank.get(owner.get(k, ""), -1)):
        found = [_storage(t) for t in pytree.tree_leaves(env[key]) if isinstance(t, torch.Tensor)]
        storages_of[key] = [s for s in found if s is not None]
        for s in storages_of[key]:
            parent[find(s)] = find(("key", key))
    groups: dict[object, list[str]] = {}
    for key, storages in storages_of.items():
        if storages:
            groups.setdefault(find(("key", key)), []).append(key)
    buffers = []
    for keys in groups.values():
        if any(k not in owner or k in returned for k in keys) or any(s in outside for k in keys
                                                                      for s in storages_of[k]):
            continue
        first_holder: dict[tuple, str] = {}
        for k in sorted(keys, key=lambda k: rank[owner[k]]):
            for s in storages_of[k]:
                first_holder.setdefault(s, owner[k])
        alloc_lanes = {lane_of[op] for op in first_holder.values()}
        if len(alloc_lanes) != 1:
            continue
        users = {owner[k] for k in keys} | {op for k in keys for op in readers.get(k, ())}
        buffers.append(Buffer(keys[0], alloc_lanes.pop(), frozenset(users), tuple(keys),
                              sum(s[1] for s in first_holder)))
    return buffers


def _storage(t: torch.Tensor) -> tuple | None:
    """A tensor's storage, as ``(identity, bytes)``: the same for every view of it; None for a tensor without a
    storage (sparse, functional wrappers) or an empty one."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    nbytes = storage.nbytes()
    return (storage._cdata, nbytes) if nbytes else None
