"""Each part of a model on the faster of ONNX Runtime and Inductor, against each engine whole, on the CPU.

    .venv/bin/python benchmarks/mixed_engines.py [--models googlenet,inception_v3,randwire,nasnet_a_mobile]
                                                 [--batch 1] [--rounds 7] [--calls 5] [--stem STEM]
                                                 [--out DIR] [--quick]

For each model, the captured graph coarsened as the default plans it (the papers' operators) and built four ways,
every graph compiled as the segment compilers make them (ONNX Runtime; Inductor with freezing), on the machine's
threads, one lane:

* ``whole onnxruntime`` and ``whole inductor``: the model as one segment;
* ``blocks onnxruntime`` and ``blocks inductor``: the model cut in capture order after each op that leaves one value
  live, its own (:func:`opweave.serve.engine.blocks.cut_points`, the serving blocks' cuts: between two of GoogLeNet's
  inception blocks one tensor is live), each run a segment.

First every build is called ``--calls`` times a round, the builds one after the other, for ``--rounds`` rounds, each
segment timed where it runs (after the segment before it); then ``mixed`` takes each block on the engine that ran it
faster there, and the wholes, ``mixed``, the blocks all on ONNX Runtime and ``peer`` (ONNX Runtime's session of the
whole model, as benchmarks/cpu_latency.py makes it) are timed the same way, whole calls only. A segment's ONNX
Runtime session, where the model is cut, sleeps its pool when idle (a pool left spinning took the cores from the next
segment's: GoogLeNet's 18 segments ran 231 ms a call against 16 ms whole). Writes ``DIR/STEM.json`` and ``.md``
(default ``benchmarks/results/mixed_engines``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import _common as common

RESULTS = Path(__file__).parent / "results"
MODELS = ("googlenet", "inception_v3", "nasnet_a_mobile", "randwire", "squeezenet", "deepfm")
ENGINES = ("onnxruntime", "inductor")


def measure(name: str, batch: int, rounds: int, calls: int, image_size: int | None = None) -> dict:
    import torch

    from opweave import zoo
    from opweave.backends.segments import Segmented
    from opweave.backends.threads import total_threads
    from opweave.capture import capture, coarsen
    from opweave.capture.coarsen import merge_ops
    from opweave.cores import intra_op_threads
    from opweave.serve.engine.blocks import cut_points, segments

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_latency import onnxruntime_session

    model, inputs = zoo.create(name, batch_size=batch, **({"image_size": image_size} if image_size else {}))
    model.eval()
    captured = coarsen(capture(model, inputs))
    threads = total_threads()
    order = captured.graph.topo_order
    levels = {"whole": [order], "blocks": segments(order, cut_points(captured))}
    built: dict[tuple[str, str], tuple] = {}
    started = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for level, groups in levels.items():
            merged = merge_ops(captured, groups)
            env = None
            for engine in ENGINES:
                segmented = Segmented(merged.graph, merged.gm, merged.nodes, signature=merged.signature,
                                      example_inputs=merged.example_inputs, compiler=engine, alone=level == "whole",
                                      threads=dict.fromkeys((g[0] for g in groups), threads))
                env = segmented.bind(tuple(inputs)) if env is None else env
                for group in groups:  # compiled here, each segment on the values the ones before it made
                    segmented.run_op(group[0], env)
                built[level, engine] = (segmented, env)
        whole = onnxruntime_session(model, inputs, parallel=False)
        whole(*inputs)
    build_s = time.perf_counter() - started

    def run(sequence, record=None) -> None:
        for segmented, op, env in sequence:
            if record is None:
                segmented.run_op(op, env)
            else:
                start = time.perf_counter()
                segmented.run_op(op, env)
                record.append((time.perf_counter() - start) * 1e3)

    def timed_rounds(sequences: dict[str, list], parts: bool = True) -> dict[str, dict]:
        """Each sequence run whole ``calls`` times a round, one after the other; with ``parts``, its segments timed in
        place too (what a segment costs where it runs in the plan, after the segment before it, the other engine's
        pools included). Medians over the rounds of the whole call and of each segment."""
        whole_ms = {name: [] for name in sequences}
        each = {name: [[] for _ in seq] for name, seq in sequences.items()}
        with intra_op_threads(threads), torch.no_grad():
            for _ in range(rounds):
                for name, sequence in sequences.items():
                    run(sequence)
                    for _ in range(calls):
                        record: list[float] | None = [] if parts else None
                        start = time.perf_counter()
                        run(sequence, record)
                        whole_ms[name].append((time.perf_counter() - start) * 1e3)
                        for i, ms in enumerate(record or []):
                            each[name][i].append(ms)
        return {name: {"ms": statistics.median(whole_ms[name]),
                       "p10": sorted(whole_ms[name])[len(whole_ms[name]) // 10],
                       "segments": [statistics.median(t) for t in each[name] if t]} for name in sequences}

    class Peer:
        def run_op(self, op, env):
            whole(*inputs)

    sequences = {f"{level} {engine}": [(built[level, engine][0], g[0], built[level, engine][1]) for g in groups]
                 for level, groups in levels.items() for engine in ENGINES}
    sequences["peer"] = [(Peer(), None, None)]
    first = timed_rounds(sequences)
    blocks_at = levels["blocks"]
    chosen = [min(ENGINES, key=lambda e, i=i: first[f"blocks {e}"]["segments"][i]) for i in range(len(blocks_at))]
    mixed = [(built["blocks", e][0], g[0], built["blocks", e][1]) for e, g in zip(chosen, blocks_at, strict=True)]
    final = timed_rounds({"whole onnxruntime": sequences["whole onnxruntime"],
                          "whole inductor": sequences["whole inductor"], "mixed": mixed,
                          "blocks onnxruntime": sequences["blocks onnxruntime"], "peer": sequences["peer"]},
                         parts=False)  # the whole calls alone: no clock read inside them
    row = {"model": name, "batch": batch, "ops": len(captured.graph), "threads": threads,
           "build_s": round(build_s, 1), "segments": len(blocks_at),
           "inductor_segments": chosen.count("inductor"),
           "choice_ms": {k: round(v["ms"], 3) for k, v in first.items()},
           "per_segment": [{"ops": len(g), **{e: round(first[f"blocks {e}"]["segments"][i], 3) for e in ENGINES}}
                           for i, g in enumerate(blocks_at)],
           **{f"{k.replace(' ', '_')}_ms": round(v["ms"], 3) for k, v in final.items()},
           **{f"{k.replace(' ', '_')}_p10_ms": round(v["p10"], 3) for k, v in final.items()}}
    best_whole = min(final["whole onnxruntime"]["ms"], final["whole inductor"]["ms"], final["peer"]["ms"])
    row["mixed_vs_best_whole"] = round(best_whole / final["mixed"]["ms"], 3)
    row["cut_cost"] = round(final["blocks onnxruntime"]["ms"] / final["whole onnxruntime"]["ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each segment a round")
    parser.add_argument("--stem", default="mixed_engines")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results (default %(default)s)")
    parser.add_argument("--image-size", type=int, help="the CNNs' image size (default: the model's own)")
    parser.add_argument("--quick", action="store_true",
                        help="squeezenet at 64x64 pixels, one round of one call (a check that it runs)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.rounds, args.calls, args.image_size = "squeezenet", 1, 1, 64
    names = common.split_names(args.models, MODELS, "model")
    clock = common.Stopwatch()
    rows = []
    for name in names:
        print(f"{name} b{args.batch} ...", flush=True)
        rows.append(measure(name, args.batch, args.rounds, args.calls, args.image_size))
        print({k: v for k, v in rows[-1].items() if k != "per_segment"}, flush=True)
    data = {"machine": common.machine_info(), "command": " ".join(["python", *sys.argv]), "rows": rows,
            "elapsed_s": clock.elapsed_s}
    common.write_json(args.out / f"{args.stem}.json", data)
    lines = ["# Each segment on its faster engine: a mixed plan against each engine whole", "",
             f"`{data['command']}` — {data['machine'].get('date', '')}, torch {data['machine'].get('torch', '')}",
             "", "ms a call, medians over interleaved rounds (p10 in brackets). `mixed`: the model cut into segments "
             "that hand few values over, each run on the engine that ran it faster in place.", "",
             "| model | batch | segments (on Inductor) | ONNX Runtime whole | Inductor whole | "
             "segments on ONNX Runtime | mixed | peer | mixed against the best whole |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[k + '_ms']:.3f} ({r[k + '_p10_ms']:.3f})"
                 for k in ("whole_onnxruntime", "whole_inductor", "blocks_onnxruntime", "mixed", "peer")]
        lines.append(f"| {r['model']} | {r['batch']} | {r['segments']} ({r['inductor_segments']}) | "
                     + " | ".join(cells) + f" | {r['mixed_vs_best_whole']:.3f}x |")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
