"""Lane programs as generated code: each lane of a program becomes one Python function, written by ``torch.fx``'s
code generator, that runs the lane's ops with the plan's signals and waits between them.

What the CPU backend (:mod:`opweave.backends.cpu`) runs instead of interpreting the steps one by one:

* **One function per lane.** :class:`LaneCode` walks the program once, before the first call (it is a
  :class:`~opweave.backends.program.Walker` whose steps *emit* code): a launch copies the op's fx nodes into the
  lane's graph (``runner.emit``: a :class:`~opweave.capture.runtime.Captured` copies its nodes, a segmented model
  emits one call of the compiled segment), a signal emits ``signal(call, k)`` and a wait emits ``wait(call, k)``.
  ``fx.GraphModule`` turns each graph into straight-line Python: no per-op dispatch, no closures, no dict.
* **Values in slots.** A value lives in a local variable of its lane's function. Values that cross lanes (read by
  an op of another lane, or by the model's output), the model's inputs and what ``bind`` computes from them are
  kept in one list of *slots* per call: the producing lane stores into its slot right after the op, a reading lane
  loads it once, at its first use, which the plan orders after the producer's signal.
* **Every intermediate freed at its last use.** fx's code generator drops a local after its last use in the lane;
  a slot is cleared at the release point that :func:`opweave.backends.liveness.release_points` proves from the
  plan's happens-before order (after which step of the producing lane every reader has finished), computed when
  the code is generated, not learned from a run. A slot with no such point (a reader that never joins back before
  the end) lives to the end of the call, as does every slot the output reads. On the CPU, memory is freed when the
  last reference goes, so a view keeps its base alive and no storage grouping is needed.
* **Thread budgets.** With ``threads`` (op -> intra-op threads, :func:`opweave.pipeline.thread_budgets.op_threads`), a
  lane calls ``torch.set_num_threads`` before an op whose budget differs from the one before it in the lane (it
  sets the calling thread's OpenMP count: :mod:`opweave.backends.threads`).
* **A failed call stops.** A lane that raises records the error in the call and releases every signal; a wait
  then raises :class:`Stopped` instead of returning, so the other lanes stop at their next wait. An error inside a
  generated function names the op and its fx node as :meth:`Captured.run_op` does (the line of the generated code
  that raised gives the node, through fx's line map).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from opweave.backends.liveness import Buffer, release_points
from opweave.backends.program import Lane, Program, Walker
from opweave.errors import CaptureError


class Stopped(Exception):  # noqa: N818 - not an error of its own: another lane failed
    """Raised by a wait of a call another lane has failed."""


def signal(call, number: int) -> None:
    """Generated code: raise signal ``number`` of ``call``."""
    call.signals[number].set()


def wait(call, number: int) -> None:
    """Generated code: wait for signal ``number`` of ``call``; :class:`Stopped` if the call failed meanwhile."""
    call.signals[number].wait()
    if call.errors:
        raise Stopped


class LaneCode(Walker):
    """The generated function of every lane of ``program`` run by ``runner`` (module docstring).

    ``functions[lane](slots, call)`` runs one lane of one call; :meth:`bind` makes the call's slots from the model's
    arguments and :meth:`output` the model's output from them.
    """

    def __init__(self, runner, program: Program, threads: dict[str, int] | None = None):
        self.runner, self._threads = runner, threads or {}
        self._current_threads: dict[Lane, int | None] = dict.fromkeys(program.lanes)
        gm = runner.gm
        self._owner = {n: op for op, group in runner.nodes.items() for n in group}
        lane_of = {step.op: lane for lane, step in program.issue_order if step.kind == "launch"}
        self._output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        returned = set(self._output_node.all_input_nodes)
        # slots: inputs and bind's values first (filled by bind), then values that leave their lane
        self.slot: dict[fx.Node, int] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder" or (node.op not in ("get_attr", "output") and node not in self._owner):
                self.slot[node] = len(self.slot)
        self._bound = list(self.slot)
        for node, op in self._owner.items():
            if node in returned or any(u in self._owner and lane_of[self._owner[u]] != lane_of[op]
                                       for u in node.users):
                self.slot[node] = len(self.slot)
        self._graphs = {lane: fx.Graph() for lane in program.lanes}
        self._args = {lane: (g.placeholder("slots"), g.placeholder("call")) for lane, g in self._graphs.items()}
        self._local: dict[Lane, dict[fx.Node, fx.Node]] = {lane: {} for lane in program.lanes}
        self._origin: dict[fx.Node, tuple[str, fx.Node]] = {}  # generated node -> (op, the model's node)
        self.run(self._with_slot_releases(program, lane_of, returned))
        self.functions: dict[Lane, Callable[[Any, Any], None]] = {}  # (slots, call)
        self.modules: dict[Lane, fx.GraphModule] = {}
        for lane, graph in self._graphs.items():
            graph.output(None)
            module = fx.GraphModule(gm, graph, class_name="Lane")
            self.modules[lane] = module
            self.functions[lane] = module.forward
        self._returned = [(n.name, self.slot[n]) for n in returned]
        self.num_slots = len(self.slot)

    # ---- code generation (the Walker's steps) --------------------------------------------------------------------
    def launch(self, lane: Lane, op: str) -> None:
        graph, local = self._graphs[lane], self._local[lane]
        slots = self._args[lane][0]

        def load(node: fx.Node) -> fx.Node:
            if node not in local:
                if node.op == "get_attr":
                    local[node] = graph.get_attr(str(node.target))
                else:
                    local[node] = graph.call_function(operator.getitem, (slots, self.slot[node]))
            return local[node]

        threads = self._threads.get(op)
        if threads is not None and threads != self._current_threads[lane]:
            graph.call_function(torch.set_num_threads, (threads,))
            self._current_threads[lane] = threads
        made = self.runner.emit(op, graph, load)
        for node, new in made.items():
            local[node] = new
            self._origin[new] = (op, node)
            if node in self.slot:
                graph.call_function(operator.setitem, (slots, self.slot[node], new))

    def signal(self, lane: Lane, number: int) -> None:
        self._graphs[lane].call_function(signal, (self._args[lane][1], number))

    def wait(self, lane: Lane, number: int) -> None:
        self._graphs[lane].call_function(wait, (self._args[lane][1], number))

    def release(self, lane: Lane, keys: tuple[str, ...]) -> None:
        slots = self._args[lane][0]
        by_name = {n.name: i for n, i in self.slot.items()}
        for key in keys:
            self._graphs[lane].call_function(operator.setitem, (slots, by_name[key], None))

    def _with_slot_releases(self, program: Program, lane_of: dict[str, Lane], returned: set) -> list:
        """The program's steps, each carrying the slots to clear after it (module docstring)."""
        from opweave.backends.liveness import steps_with_releases

        buffers = []
        for node, op in self._owner.items():
            if node in self.slot and node not in returned:
                users = frozenset({op, *(self._owner[u] for u in node.users if u in self._owner)})
                buffers.append(Buffer(node.name, lane_of[op], users, (node.name,)))
        return steps_with_releases(program, release_points(program, buffers))

    # ---- calls ---------------------------------------------------------------------------------------------------
    def bind(self, args: tuple) -> list:
        """The slots of one call: the model's inputs and what ``bind`` computes from them."""
        env = self.runner.bind(args)
        slots = [None] * self.num_slots
        for i, node in enumerate(self._bound):
            slots[i] = env[node.name]
        return slots

    def output(self, slots: list) -> Any:
        return self.runner.output({name: slots[i] for name, i in self._returned})

    def error(self, lane: Lane, exc: BaseException) -> BaseException:
        """``exc``, raised in ``lane``'s function, as :meth:`Captured.run_op` would have raised it: a
        :class:`CaptureError` naming the op and its fx node when the line that raised maps to one."""
        if isinstance(exc, (CaptureError, Stopped)):
            return exc
        module = self.modules[lane]
        code = type(module).forward.__code__
        tb, frame = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code is code:
                frame, lineno = tb.tb_frame, tb.tb_lineno
            tb = tb.tb_next
        lines = getattr(module, "_lineno_map", None)
        if frame is None or lines is None or not isinstance(exc, Exception):
            return exc
        index = lines.get(lineno - code.co_firstlineno)
        nodes = list(module.graph.nodes)
        made = nodes[index] if index is not None and index < len(nodes) else None
        if made not in self._origin:
            return exc
        op, node = self._origin[made]
        # the failing node's arguments, from the generated function's locals, for the message's shapes
        pairs = zip(node.all_input_nodes, made.all_input_nodes, strict=False)
        env = {a.name: frame.f_locals.get(b.name) for a, b in pairs}
        return self.runner._failure(op, node.name, exc, env)


def code_of(lanes: LaneCode) -> str:
    """The generated source of every lane, for reading and debugging."""
    return "\n".join(f"# lane {lane}\n{module.code}" for lane, module in sorted(lanes.modules.items()))


__all__ = ["LaneCode", "Stopped", "code_of", "signal", "wait"]
