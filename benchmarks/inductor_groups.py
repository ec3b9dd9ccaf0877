"""Inductor kernels per call on the CPU: the whole model compiled once, against a plan's segments compiled one by one
over opweave's ops (``graph="fx"``, ``compiler="inductor"``) and over Inductor's own kernels (``graph="inductor"``).

    .venv/bin/python benchmarks/inductor_groups.py [--models googlenet,inception_v3] [--scheduler opara]
                                                   [--streams 8] [--image-size N] [--quick] [--out DIR]

For each model at batch 1 (float32, the CPU), three builds, every graph compiled by TorchInductor with the segment
compiler's settings (:class:`opweave.backends.compilers.Inductor`: frozen, as every CPU segment is):

* ``whole`` — the captured model as one graph (:func:`opweave.backends.segments.whole_module`), what
  ``torch.compile`` with freezing compiles;
* ``fx+inductor`` — ``opweave.compile(..., scheduler=S, streams=N, compiler="inductor")``: the coarsened captured
  graph planned, each stream segment compiled on its own (how the GPU benchmark's ``S+inductor`` rows are built);
* ``inductor-graph`` — ``opweave.compile(..., scheduler=S, streams=N, graph="inductor")``: the same scheduler over
  Inductor's kernels (:mod:`opweave.backends.inductorgraph`), each segment compiled on its own.

Counted per call, over every graph a build compiles (each segment runs once per call), with Inductor's caches off so
that every graph is lowered and generated:

* ``launches`` — the kernels a call runs on the CPU: calls of generated C++ kernels and of extern kernels
  (oneDNN convolutions, matrix products, ATen fallbacks) in the generated wrapper's ``call``. Inductor's C++
  backend emits consecutive pointwise nodes as one C++ function, so this is lower than what the same fusion
  launches on a GPU;
* ``fused_nodes`` — the scheduler's nodes after fusion that launch something (each is one Triton kernel or one
  extern call where Inductor generates for a GPU, though CUDA lowers some ops differently: convolutions stay
  unfused, biases are peeled off into pointwise kernels): the count that speaks for CUDA.

Also recorded: segments, segments run op by op (``fallbacks``), and for ``inductor-graph`` the ops of its graph and
the kernels the grouping predicts (the whole compile's launching nodes, each counted in every group it spans).
``--unfrozen`` compiles every graph without freezing, as the segment compiler does on CUDA: convolutions stay ATen's
extern calls, BatchNorm and activations are Inductor's epilogue kernels, and a concatenation's inputs are written in
place, the structure a CUDA compile has (CUDA differs still: a convolution's bias is peeled off into its epilogue,
and a pooling or pointwise kernel is a Triton kernel). Writes ``DIR/inductor_groups.json``
(``inductor_groups_unfrozen.json``; ``--quick``: squeezenet at 64x64 pixels, ``..._quick.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path
from unittest import mock

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+|aten\.[\w.]+)\(", re.M)


class Counter:
    """Counts what each Inductor compile inside its ``with`` block generates (module docstring)."""

    def __init__(self):
        self.graphs = self.launches = self.fused_nodes = 0

    def __enter__(self) -> Counter:
        import torch
        from torch._inductor import config
        from torch._inductor.graph import GraphLowering
        from torch._inductor.scheduler import Scheduler

        from opweave.backends.inductorgraph import launches

        codegen, schedule = GraphLowering.codegen, Scheduler.codegen

        def count_code(lowering):
            result = codegen(lowering)
            code = result[0] if isinstance(result, tuple) else result
            text = getattr(code, "value", code)
            body = text[text.index("def call("):] if "def call(" in text else text
            self.graphs += 1
            self.launches += len(CALL.findall(body.split("\ndef ", 1)[0] if "\ndef " in body else body))
            return result

        def count_nodes(scheduler):
            self.fused_nodes += sum(launches(node) for node in scheduler.nodes)
            return schedule(scheduler)

        self._patches = [mock.patch.object(GraphLowering, "codegen", count_code),
                         mock.patch.object(Scheduler, "codegen", count_nodes),
                         config.patch(fx_graph_cache=False),
                         torch._functorch.config.patch(enable_autograd_cache=False)]
        for p in self._patches:
            p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self._patches):
            p.__exit__(*exc)

    def row(self) -> dict:
        return {"graphs": self.graphs, "launches": self.launches, "fused_nodes": self.fused_nodes}


def measure(name: str, image_size: int | None, scheduler: str, streams: int) -> dict:
    import torch

    import opweave
    from opweave import zoo
    from opweave.backends.compilers import Inductor
    from opweave.backends.inductorgraph import inductor_graph
    from opweave.backends.segments import whole_module
    from opweave.capture import capture
    from opweave.outputs import compare

    model, inputs = zoo.create(name, batch_size=1, **({"image_size": image_size} if image_size else {}))
    captured = capture(model, inputs)
    with torch.inference_mode():
        expected = model(*inputs)
    row: dict = {"model": name, "input_shape": list(inputs[0].shape)}
    start = time.perf_counter()
    with Counter() as whole:
        graph = whole_module(captured, inputs)
        Inductor()(graph.gm, graph.inputs, torch.get_num_threads())
    row["whole"] = {**whole.row(), "compile_s": round(time.perf_counter() - start, 1)}
    regrouped = inductor_graph(captured, inputs)
    for label, options in (("fx+inductor", {"compiler": "inductor"}), ("inductor-graph", {"graph": "inductor"})):
        start = time.perf_counter()
        with Counter() as counted:
            fast = opweave.compile(model, inputs, device="cpu", scheduler=scheduler, streams=streams, **options)
        with torch.inference_mode():
            check = compare(expected, fast(*inputs))
        row[label] = {**counted.row(), "ops": len(fast.graph), "segments": fast.fused.stats["segments"],
                      "fallbacks": fast.fused.stats["fallbacks"], "streams_used": fast.schedule.streams_used,
                      "compile_s": round(time.perf_counter() - start, 1), "ok": check.ok}
        fast.close()
    row["inductor-graph"]["predicted_fused_nodes"] = sum(regrouped.kernels.values()) + regrouped.stats["unowned"]
    row["inductor-graph"]["grouping"] = regrouped.stats
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="googlenet,inception_v3")
    p.add_argument("--scheduler", default="opara")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--image-size", type=int, default=None, help="input size (default: each model's own)")
    p.add_argument("--unfrozen", action="store_true", help="every graph compiled without freezing, as on CUDA")
    p.add_argument("--quick", action="store_true", help="squeezenet at 64x64")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    import torch

    if args.unfrozen:  # the lowering CUDA gets: convolutions as ATen's, epilogues and concatenations Inductor's
        from opweave.backends.compilers import Inductor

        Inductor.freezes = lambda self, inputs: False
    models = ["squeezenet"] if args.quick else args.models.split(",")
    size = 64 if args.quick else args.image_size
    command = " ".join(["benchmarks/inductor_groups.py", *(sys.argv[1:] if argv is None else argv)])
    out = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()},
           "settings": {"scheduler": args.scheduler, "streams": args.streams, "batch_size": 1, "dtype": "float32",
                        "frozen": not args.unfrozen, "image_size": size, "command": command},
           "results": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"inductor_groups{'_unfrozen' if args.unfrozen else ''}{'_quick' if args.quick else ''}.json"
    for name in models:  # the file is written again after each model
        out["results"].append(r := measure(name, size, args.scheduler, args.streams))
        print(f"{name}: whole {r['whole']['launches']} launches / {r['whole']['fused_nodes']} fused nodes; "
              f"fx+inductor {r['fx+inductor']['launches']} / {r['fx+inductor']['fused_nodes']} "
              f"({r['fx+inductor']['segments']} segments); inductor-graph {r['inductor-graph']['launches']} / "
              f"{r['inductor-graph']['fused_nodes']} ({r['inductor-graph']['segments']} segments)", flush=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
