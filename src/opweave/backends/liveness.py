"""When may a backend free a buffer that several streams read? A liveness analysis that knows about joins, and
the buffers it is run on.

The CUDA caching allocator hands a freed block back to the pool of the stream that *allocated* it, and gives it to
the next allocation on that same stream at once, without waiting for other streams. So freeing a
buffer (dropping its last reference on the host) is safe at a point of the allocating stream's lane only when that
point is ordered — through the lane's own FIFO order and the plan's record/wait joins — after the launch of every op
that uses the buffer (reads it, writes it in place, or holds a view of it). Anything issued later to the allocating
stream then starts after those uses have finished, and it is the only work that can reuse the block.

:func:`release_points` finds, for every buffer, the earliest such point on its allocating lane; a buffer with no
such point is kept until the final join (the caller's environment is dropped after the call, or the capture ends).

Happens-before is that of :mod:`opweave.plan.semantics`, run on the program's plan: ``clock[lane][i][m]`` is how
many steps of lane ``m`` are ordered at or before step ``i`` of ``lane`` (its own entry counts step ``i`` itself; a
program's step ``i`` is the semantics' position ``i + 1``). Because a wait is always issued after the record it
refers to, every use ordered before a release point was also issued (on the host) before it, so a host-side
interpreter can apply the releases in issue order.

**Which buffers.** :func:`storage_buffers` finds them in the environment of a finished run that kept every
intermediate: entries are grouped by the storage they share (views and in-place results included), and each group's
allocating lane is the lane of the first op that held it. Groups that are model inputs, parameters or anything
computed in ``bind``, groups the output returns, and groups allocated on several lanes are left out (kept to the
end). :func:`release_keys` turns the release points into environment keys, and :func:`steps_with_releases` puts
them on the steps a :class:`~opweave.backends.program.Walker` runs (the CUDA backend does; see its docstring).

Complexity: O(S·L) for the clocks (S steps, L lanes), then O(U·log S) per buffer with U users.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch.utils import _pytree as pytree

from opweave.backends.program import Lane, Program, Step
from opweave.capture.runtime import Captured
from opweave.plan.launchplan import Instr
from opweave.plan.semantics import Clock, PlanInterpreter, Point


@dataclass(frozen=True)
class Buffer:
    """One allocation seen by the interpreter: where it was allocated and which ops touch it.

    ``keys`` are the environment entries (fx node names) that hold references to it; they are dropped together.
    """

    name: str
    alloc_lane: Lane
    users: frozenset[str]
    keys: tuple[str, ...] = ()


def vector_clocks(program: Program) -> dict[Lane, list[Clock]]:
    """``clocks[lane][i]``: for every lane, how many of its steps are ordered at or before step ``i`` of ``lane``."""
    return _StepClocks().run(program.plan)


class _StepClocks(PlanInterpreter):
    """The plan's interpreter, keeping a copy of the clock at every instruction, by lane."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict[Lane, list[Clock]] = {}

    def run_instr(self, i: int, ins: Instr, at: Point) -> None:
        self.clocks.setdefault(at[0], []).append(dict(self.clock[at[0]]))

    def output(self) -> dict[Lane, list[Clock]]:
        return self.clocks


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
    step of that lane. Buffers that appear in no entry must be kept until the final join.

    Tiny example: lane A launches ``x`` then records signal 0; lane B waits on it and launches ``y``; lane A then
    waits for signal 1 raised by B after ``y``. A buffer allocated on A and read by ``y`` is released right after
    A's wait for signal 1 (not after ``x``, and not at all if A never waits for B).
    """
    clocks = vector_clocks(program)
    where = launch_positions(program)
    out: dict[tuple[Lane, int], list[str]] = {}
    for buf in buffers:
        if not buf.users:
            raise ValueError(f"buffer {buf.name!r} has no users (its allocating op at least must be one)")
        missing = [u for u in buf.users if u not in where]
        if missing:
            raise ValueError(f"buffer {buf.name!r}: user op {missing[0]!r} is not launched by the plan")
        if buf.alloc_lane not in clocks:
            raise ValueError(f"buffer {buf.name!r}: allocating lane {buf.alloc_lane} has no steps")
        lane_clocks = clocks[buf.alloc_lane]
        # Clocks only grow along a lane, so the first covering step of each use can be found by bisection.
        earliest = 0
        for use_lane, use_index in (where[u] for u in buf.users):
            first = bisect_left(lane_clocks, use_index + 1, key=lambda c, m=use_lane: c.get(m, 0))
            earliest = max(earliest, first)
        if earliest < len(lane_clocks):
            out.setdefault((buf.alloc_lane, earliest), []).append(buf.name)
    return out


def release_keys(captured: Captured, env: dict, program: Program) -> dict[tuple[Lane, int], list[str]]:
    """From the environment of a finished keep-all run: after which step of which lane each env key may be dropped."""
    buffers = storage_buffers(captured, env, program)
    keys = {b.name: b.keys for b in buffers}
    return {at: [k for name in group for k in keys[name]] for at, group in release_points(program, buffers).items()}


def storage_buffers(captured: Captured, env: dict, program: Program) -> list[Buffer]:
    """Group the environment of a finished keep-all run by shared storage (a view, an in-place result and its base
    are one group) into :class:`Buffer` s for the liveness analysis.

    Only groups computed by ops are returned: a group that holds a model input, a parameter or anything computed
    in ``bind``, a group the output returns, and a group allocated by ops on several lanes are left out (kept).
    """
    launches = [(lane, step.op) for lane, step in program.issue_order if step.kind == "launch"]
    lane_of = {op: lane for lane, op in launches}
    issue_order = [op for _, op in launches]
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    readers = captured.readers()
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    returned = {n.name for n in output.all_input_nodes}
    rank = {op: i for i, op in enumerate(issue_order)}

    parent: dict[object, object] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    storages_of: dict[str, list[tuple]] = {}
    for key, value in env.items():
        found = [_storage(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        storages_of[key] = [s for s in found if s is not None]
        for s in storages_of[key]:
            parent[find(s)] = find(("key", key))
    groups: dict[object, list[str]] = {}
    for key, found in storages_of.items():
        if found:
            groups.setdefault(find(("key", key)), []).append(key)
    buffers = []
    for keys in groups.values():
        if any(k not in owner or k in returned for k in keys):
            continue
        first_holder: dict[tuple, str] = {}
        for k in sorted(keys, key=lambda k: rank[owner[k]]):
            for s in storages_of[k]:
                first_holder.setdefault(s, owner[k])
        alloc_lanes = {lane_of[op] for op in first_holder.values()}
        if len(alloc_lanes) != 1:
            continue
        users = {owner[k] for k in keys} | {op for k in keys for op in readers.get(k, ())}
        buffers.append(Buffer(keys[0], alloc_lanes.pop(), frozenset(users), tuple(keys)))
    return buffers


def _storage(t: torch.Tensor) -> tuple | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
        return None
    return (str(t.device), ptr) if ptr else None
