"""What pipelining can add over batching on this CPU: each serving model's compute capacity in ONNX Runtime (what
``opweave serve --device cpu`` runs its blocks with), one session on every core against one one-thread session per
core side by side.

    .venv/bin/python benchmarks/serving_bound.py [--models inception_v3,resnet50,squeezenet] [--seconds 2] [--quick]

For each model at its published input size (Inception-v3 299, the others 224), each batch size in ``--batches``,
interleaved over ``--rounds`` rounds: samples per second of (a) one ORT session with intra-op threads = the cores,
called in a loop (what ``batch`` runs: one stacked batch at a time on every core), and (b) one one-thread session
per core, each called in a loop by its own thread on its own batch, all at once (the most that running parts side
by side, as ``heuristic``'s combined blocks do, can get: every core busy, no barrier between the parts, no
imbalance). ``bound`` = best (b) / best (a): the most any side-by-side policy can sustain over ``batch`` when the
engine's time is all ORT compute (a profile of ``opweave serve --policy batch`` under load found its engine thread
in ORT 95% of the time). Writes ``benchmarks/results/serving_bound.json``.
"""

from __future__ import annotations

import statistics
import threading
import time

import _common as common

SIZES = {"inception_v3": 299}


def session(model, example, threads: int):
    from opweave.backends.compilers import get
    from opweave.capture import capture

    gm = capture(model, (example,)).gm
    return get("onnxruntime")(gm, [example], threads, alone=threads > 1)


def loop(fn, x, seconds: float, counts: list, slot: int, start: threading.Barrier) -> None:
    start.wait()
    end, n = time.perf_counter() + seconds, 0
    try:
        while time.perf_counter() < end:
            fn(x)
            n += 1
    except Exception as exc:  # noqa: BLE001 - re-raised by rate()
        n = exc
    counts[slot] = n


def rate(fns: list, x, seconds: float) -> float:
    """Samples per second of ``fns`` each called in a loop by its own thread, all at once, for ``seconds``."""
    counts = [0] * len(fns)
    start = threading.Barrier(len(fns) + 1)
    threads = [threading.Thread(target=loop, args=(fn, x, seconds, counts, i, start)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    begin = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    for n in counts:
        if isinstance(n, Exception):
            raise n
    return sum(counts) * x.shape[0] / (time.perf_counter() - begin)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,16", help="comma list of batch sizes (default %(default)s)")
    p.add_argument("--seconds", type=float, default=2.0, help="per setting and round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.quick:  # a smoke run: one small model, one batch size, short timings
        args.models, args.batches, args.seconds, args.rounds = args.models or "squeezenet", "1", 0.3, 1
    import torch

    from opweave import zoo
    from opweave.cores import cores

    n = cores()
    models = common.split_names(args.models, ("inception_v3", "resnet50", "squeezenet"), "model") or [
        "inception_v3", "resnet50", "squeezenet"]
    batches = [int(b) for b in args.batches.split(",")]
    clock = common.Stopwatch()
    results = {}
    for name in models:
        size = SIZES.get(name, 224)
        model, _ = zoo.create(name, batch_size=1, image_size=size)
        inputs = {b: torch.randn(b, 3, size, size) for b in batches}
        whole = {b: session(model, x, n) for b, x in inputs.items()}  # one session per batch: captures bake it in
        lanes = {b: [session(model, x, 1) for _ in range(n)] for b, x in inputs.items()}
        rates: dict[str, dict[int, list[float]]] = {"one session, every core": {},
                                                    "one-thread sessions side by side": {}}
        for _ in range(args.rounds):
            for b, x in inputs.items():
                rates["one session, every core"].setdefault(b, []).append(rate([whole[b]], x, args.seconds))
                rates["one-thread sessions side by side"].setdefault(b, []).append(rate(lanes[b], x, args.seconds))
        medians = {k: {b: round(statistics.median(v), 2) for b, v in per.items()} for k, per in rates.items()}
        best = {k: max(per.values()) for k, per in medians.items()}
        results[name] = {"image_size": size, "samples_per_s": medians, "best": best,
                         "bound": round(best["one-thread sessions side by side"] / best["one session, every core"],
                                        3)}
        common.console.print(f"{name}: {medians} bound {results[name]['bound']}")
    rows = [[m, f"{r['best']['one session, every core']:.1f}", f"{r['best']['one-thread sessions side by side']:.1f}",
             f"{r['bound']:.2f}"] for m, r in results.items()]
    common.console.print(common.table("ORT capacity (samples/s, best batch)", ["model", "one session, every core",
                                      "one-thread sessions side by side", "bound"], rows))
    out = {"settings": {"cores": n, "batches": batches, "seconds": args.seconds, "rounds": args.rounds,
                        "torch": torch.__version__},
           "machine": common.machine_info(), "elapsed_s": clock.elapsed_s, "results": results}
    common.write_json(args.out / "serving_bound.json", out)


if __name__ == "__main__":
    main()
