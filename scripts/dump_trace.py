"""Write a real Kineto trace of one zoo model's ops, each in its ``opweave::<op>`` range, as gzipped JSON.

    python3 scripts/dump_trace.py googlenet out/googlenet-trace.json.gz

Run on a GPU machine; the trace becomes the fixture of the profiler's CPU tests (tests/data/).
"""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from opweave import zoo
from opweave.capture import capture
from opweave.costs.profile import full_env
from opweave.costs.profile.kineto import RANGE_PREFIX


def main(name: str, out: str) -> None:
    model, inputs = zoo.create(name, batch_size=1)
    model, inputs = model.cuda().eval(), tuple(x.cuda() for x in inputs)
    captured = capture(model, inputs, name=name)
    with torch.no_grad():
        env = full_env(captured, inputs)
        for op in captured.graph.topo_order:  # warm: no first-call cuDNN/cuBLAS set-up in the trace
            captured.run_op(op, env)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for op in captured.graph.topo_order:
                with record_function(RANGE_PREFIX + op):
                    captured.run_op(op, env)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    trace["opweave"] = {"model": name, "ops": captured.graph.ids,
                        "flops": {o.id: o.flops for o in captured.graph.ops}, "torch": torch.__version__,
                        "device": torch.cuda.get_device_name()}
    with gzip.open(out, "wt") as f:
        json.dump(trace, f)
    print(f"wrote {out}: {len(trace.get('traceEvents', []))} events, {len(captured.graph)} ops")


if __name__ == "__main__":
    main(*sys.argv[1:3])
