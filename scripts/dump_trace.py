"""Write a real Kineto trace of one zoo model's ops, as the profiler records it, to a gzipped JSON file.

    python3 scripts/dump_trace.py googlenet out/googlenet-trace.json.gz [--repeats 3]

Needs a GPU (without one: one line on stderr, exit status 2). The model is captured on CUDA and every op is warmed
up, then run ``--repeats`` times under ``torch.profiler``, each run inside its own ``opweave::<op>`` range: exactly what
:func:`opweave.costs.profile.profile_model` traces (:func:`opweave.costs.profile.kineto.trace_ops`). The trace gets
an extra top-level ``"opweave"`` entry (model, ops in order, each op's FLOPs and target, repeats, torch, device),
so that the CPU tests can check their parsing on it without the model (tests/data/, ``test_cuda_cpu_paths``).
The script then parses its own trace and prints one line: ranges, kernels, and the ops whose GPU work was found.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

import torch

from opweave.capture import load
from opweave.costs.profile import full_env
from opweave.costs.profile.kineto import range_runs, trace_ops
from opweave.costs.profile.measure import latencies_from_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=3, help="runs of each op in the trace (default %(default)s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"dump_trace: CUDA is not available (torch {torch.__version__}); a real trace needs a GPU",
              file=sys.stderr)
        return 2
    _, inputs, captured = load(args.model, device="cuda", coarsen=False)
    graph = captured.graph
    with torch.no_grad():
        env = full_env(captured, inputs)
        for op in graph.topo_order:  # warm: no first-call cuDNN/cuBLAS set-up in the trace
            captured.run_op(op, env)
        torch.cuda.synchronize()
        trace = trace_ops(captured, env, graph.topo_order, args.repeats, "cuda")
    trace["opweave"] = {"model": args.model, "ops": graph.topo_order, "repeats": args.repeats,
                        "flops": {o.id: o.flops for o in graph.ops}, "targets": {o.id: o.target for o in graph.ops},
                        "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    with gzip.open(args.out, "wt") as f:
        json.dump(trace, f)
    runs = range_runs(trace)
    latency, kernels = latencies_from_runs(graph, runs)  # raises ProfileError if attribution failed
    busy = sum(1 for ms in latency.values() if ms > 0)
    print(f"wrote {args.out}: {len(trace.get('traceEvents', []))} events, {len(runs)} op ranges for {len(graph)} ops "
          f"x {args.repeats}, {sum(len(k) for k in kernels.values())} kernels in the median runs, {busy} ops with "
          f"GPU work, sum of op latencies {sum(latency.values()):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
