"""Can lanes beat ONNX Runtime on this CPU if ORT optimizes the whole model first? An experiment, not a mode.

    .venv/bin/python benchmarks/ort_lanes.py [--models nasnet_a_mobile,randwire] [--syncs 0.05,0.1,0.3,1]
                                             [--rounds 10] [--out DIR]

``fuse="onnxruntime"`` exports each segment of a plan on its own, so ORT optimizes each alone: its NCHWc layout
(convolutions in 8-channel blocks, which doubles NASNet's speed) is undone at every segment boundary. Here the
order is turned round: ORT optimizes the **whole** model once (``ORT_ENABLE_ALL``, one thread; the optimized graph
saved), each node of that graph is one op of an :class:`~opweave.ir.graph.OpGraph` with its kernel time from ORT's
own profiler, HEFT plans it on one lane per core with a sync cost per cross-lane edge, the plan is lowered and
validated, and each segment (:func:`opweave.backends.segments.segment_groups`) becomes a session of those optimized
nodes with ORT's optimizations off, so tensors cross boundaries in whatever layout the whole graph had. The lanes
are Python threads, each running its segments in plan order with a ``threading.Event`` per sync (ORT releases the
GIL while it runs).

Timed interleaved in one process per model (median and minimum over ``--rounds`` rounds of 5 calls): ORT whole at
one thread and at every core (its default, the peer ``cpu_latency.py`` compares with), the lanes at each sync cost,
and each partition's segments run one after another on one thread (``in_a_row``: what cutting the optimized graph
costs ORT without any parallelism). Every lane output is checked against ORT whole (exactly equal: the same kernels).
Writes ``DIR/ort_lanes.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common as common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="nasnet_a_mobile,randwire,googlenet,inception_v3")
    p.add_argument("--syncs", default="0.05,0.1,0.3,1.0", help="HEFT sync costs (ms) to try")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.syncs = [float(s) for s in args.syncs.split(",")]
    return args


class Optimized:
    """A model's ORT-optimized graph, its nodes' kernel times (ms, one thread) and the op graph over them."""

    def __init__(self, name: str, tmp: Path):
        import onnx
        import onnxruntime as ort
        from onnx import helper

        from opweave import zoo
        from opweave.backends.compilers import export_onnx
        from opweave.costs.model import from_graph
        from opweave.ir.graph import Edge, Op, OpGraph

        self.ort, self.helper = ort, helper
        model, inputs = zoo.create(name)
        raw = export_onnx(model.eval(), list(inputs), 1)
        path = tmp / f"{name}.onnx"
        self.session(raw, 1, optimize=True, save=path)
        self.model = onnx.load(str(path))
        graph = self.model.graph
        for i, node in enumerate(graph.node):
            node.name = node.name or f"node{i}"
        self.node = {n.name: n for n in graph.node}
        self.initializer = {t.name: t for t in graph.initializer}
        self.feed = {graph.input[0].name: inputs[0].numpy()}
        self.outputs = [o.name for o in graph.output]
        self.whole_1 = self.session(path, 1)
        self.whole_all = self.session(raw, None, optimize=True)
        # every intermediate value once, for the segments' input and output types and shapes
        produced = [o for n in graph.node for o in n.output if o]
        everything = onnx.ModelProto()
        everything.CopyFrom(self.model)
        del everything.graph.output[:]
        everything.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in produced)
        self.values = {**self.feed, **dict(zip(produced, self.session(everything.SerializeToString(), 1).run(
            produced, self.feed), strict=True))}
        self.latency_ms = self._profile(path, tmp / name)
        producer = {o: n.name for n in graph.node for o in n.output if o}
        self.graph = OpGraph([Op(id=n.name, latency_ms=max(self.latency_ms[n.name], 1e-4)) for n in graph.node],
                             [Edge(producer[i], n.name) for n in graph.node for i in dict.fromkeys(n.input)
                              if i in producer and producer[i] != n.name], name=name)
        self.costs = from_graph(self.graph)

    def session(self, model, threads: int | None, optimize: bool = False, save: Path | None = None, profile=None):
        ort = self.ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else
                                            ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        if threads is not None:
            options.intra_op_num_threads = threads
        if save is not None:
            options.optimized_model_filepath = str(save)
        if profile is not None:
            options.enable_profiling, options.profile_file_prefix = True, str(profile)
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                    providers=["CPUExecutionProvider"])

    def _profile(self, path: Path, prefix: Path, runs: int = 20) -> dict[str, float]:
        session = self.session(path, 1, profile=prefix)
        for _ in range(runs + 3):
            session.run(None, self.feed)
        times = collections.defaultdict(list)
        for event in json.loads(Path(session.end_profiling()).read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                times[event["name"].removesuffix("_kernel_time")].append(event["dur"] / 1e3)
        return {n: statistics.median(times[n][3:]) if times.get(n) else 0.0 for n in self.node}

    def partition(self, sync_ms: float) -> Partition:
        from opweave.api import plan_for
        from opweave.backends.program import Program
        from opweave.backends.segments import segment_groups, segment_plan
        from opweave.backends.threads import cores

        schedule, plan = plan_for(self.graph, self.costs, "heft", streams=cores(), sync_ms=sync_ms)
        groups = segment_groups(plan)
        return Partition(self, schedule, groups, Program.from_plan(segment_plan(plan, groups)))

    def segment(self, group: list[str]):
        """One session of ``group``'s optimized nodes, optimizations off; (run, input names, output names)."""
        helper = self.helper
        made = {o for op in group for o in self.node[op].output if o}
        inside = set(group)
        read_outside = {i for n in self.node.values() if n.name not in inside for i in n.input} | set(self.outputs)
        inputs = list(dict.fromkeys(i for op in group for i in self.node[op].input
                                    if i and i not in made and i not in self.initializer))
        weights = list(dict.fromkeys(i for op in group for i in self.node[op].input if i in self.initializer))
        outputs = [o for op in group for o in self.node[op].output if o in made and o in read_outside]

        def info(name: str):
            value = self.values[name]
            return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                 list(value.shape))

        sub = helper.make_graph([self.node[op] for op in group], group[0], [info(i) for i in inputs],
                                [info(o) for o in outputs], [self.initializer[w] for w in weights])
        model = helper.make_model(sub, opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        session = self.session(model.SerializeToString(), 1)
        return session._sess.run, inputs, outputs, self.ort.RunOptions()


class Partition:
    def __init__(self, owner: Optimized, schedule, groups: list[list[str]], program):
        self.owner, self.schedule, self.program = owner, schedule, program
        self.segments = {group[0]: owner.segment(group) for group in groups}
        self.order = [i.op for i in program.plan.instrs if i.kind == "launch"]
        self.lanes = list(program.lanes.values())

    def _run(self, env: dict, name: str) -> None:
        run, inputs, outputs, options = self.segments[name]
        env.update(zip(outputs, run(outputs, {i: env[i] for i in inputs}, options), strict=True))

    def lanes_call(self) -> list:
        env = dict(self.owner.feed)
        signals = [threading.Event() for _ in range(self.program.num_signals)]

        def lane(steps) -> None:
            for step in steps:
                if step.kind == "launch":
                    self._run(env, step.op)
                elif step.kind == "signal":
                    signals[step.signal].set()
                else:
                    signals[step.signal].wait()

        others = [threading.Thread(target=lane, args=(steps,)) for steps in self.lanes[1:]]
        for t in others:
            t.start()
        lane(self.lanes[0])
        for t in others:
            t.join()
        return [env[o] for o in self.owner.outputs]

    def in_a_row(self) -> list:
        env = dict(self.owner.feed)
        for name in self.order:
            self._run(env, name)
        return [env[o] for o in self.owner.outputs]


def measure(name: str, args: argparse.Namespace) -> dict:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="ort_lanes_") as tmp:
        opt = Optimized(name, Path(tmp))
        expected = opt.whole_1.run(opt.outputs, opt.feed)
        calls = {"ort whole, 1 thread": lambda: opt.whole_1.run(None, opt.feed),
                 "ort whole, every core": lambda: opt.whole_all.run(None, opt.feed)}
        partitions = {}
        for sync in args.syncs:
            part = opt.partition(sync)
            for label, fn in ((f"lanes, sync {sync}", part.lanes_call), (f"in a row, sync {sync}", part.in_a_row)):
                diff = max(float(np.abs(a - b).max()) for a, b in zip(fn(), expected, strict=True))
                if diff != 0.0:
                    raise SystemExit(f"{name} {label}: differs from ORT whole by {diff}")
                calls[label] = fn
            partitions[sync] = {"segments": len(part.order), "syncs": part.program.num_signals,
                                "predicted_ms": round(part.schedule.predicted_ms, 3)}
        times = {label: [] for label in calls}
        for fn in calls.values():
            fn()
            fn()
        for _ in range(args.rounds):
            for label, fn in calls.items():
                for _ in range(5):
                    start = time.perf_counter()
                    fn()
                    times[label].append((time.perf_counter() - start) * 1e3)
    stats = {label: {"median_ms": round(statistics.median(ts), 3), "min_ms": round(min(ts), 3)}
             for label, ts in times.items()}
    best = min((s for s in args.syncs), key=lambda s: stats[f"lanes, sync {s}"]["median_ms"])
    return {"model": name, "nodes": len(opt.graph), "kernel_sum_ms": round(sum(opt.latency_ms.values()), 3),
            "critical_path_ms": round(opt.graph.critical_path_ms(opt.costs.latency_ms), 3), "times": stats,
            "partitions": {str(k): v for k, v in partitions.items()}, "best_sync": best,
            "best_lanes_vs_ort_every_core": round(stats["ort whole, every core"]["median_ms"]
                                                  / stats[f"lanes, sync {best}"]["median_ms"], 3),
            "in_a_row_vs_whole_1_thread": round(stats[f"in a row, sync {best}"]["median_ms"]
                                                / stats["ort whole, 1 thread"]["median_ms"], 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        common.console.print(f"{name}: optimize, profile, partition, time", style="dim")
        rows.append(measure(name, args))
        common.console.print(rows[-1])
        common.write_json(args.out / "ort_lanes.json", {"machine": common.machine_info(), "settings": {
            "models": args.models, "syncs": args.syncs, "rounds": args.rounds}, "rows": rows}, quiet=True)
    cells = []
    for r in rows:
        t, best = r["times"], r["best_sync"]
        cells.append([r["model"], str(r["nodes"]), f"{t['ort whole, 1 thread']['median_ms']:.2f}",
                      f"{t['ort whole, every core']['median_ms']:.2f}",
                      f"{t['lanes, sync ' + str(best)]['median_ms']:.2f} (sync {best})",
                      f"{r['best_lanes_vs_ort_every_core']:.2f}x", f"{r['in_a_row_vs_whole_1_thread']:.2f}x"])
    common.console.print(common.table("Lanes over ORT's whole-model optimized graph (median ms)",
                                      ["model", "nodes", "ORT 1 thread", "ORT every core", "best lanes",
                                       "lanes vs ORT", "segments in a row vs whole"], cells))
    common.console.print(f"wrote {args.out / 'ort_lanes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
