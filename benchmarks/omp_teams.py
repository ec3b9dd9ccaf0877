"""Why the CPU lanes' workers run on one intra-op thread: a thread that holds a bigger OpenMP team slows every
OpenMP kernel of the process (libgomp throttles its spin-wait once the threads in teams outnumber the cores).

    .venv/bin/python benchmarks/omp_teams.py [--model googlenet] [--runs 20]

Eager ``--model`` at batch 1 on the caller's threads (every core), timed three ways in one process, interleaved
over rounds (median ms): nothing else alive; while two idle threads hold one-thread teams (each ran one matmul on
one thread, then sleeps); while two idle threads hold two-thread teams. Prints the table and writes
``benchmarks/results/omp_teams.json``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import _common as common


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="googlenet")
    p.add_argument("--runs", type=int, default=20, help="timed calls per setting and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from opweave import zoo
    from opweave.cores import cores

    model, inputs = zoo.create(args.model, batch_size=1)
    threads = torch.get_num_threads()

    def timed() -> list[float]:
        with torch.inference_mode():
            model(*inputs)
            out = []
            for _ in range(args.runs):
                start = time.perf_counter()
                model(*inputs)
                out.append((time.perf_counter() - start) * 1e3)
        return out

    def holders(team: int) -> threading.Event:
        """Two threads that run one kernel on ``team`` threads, then sleep until the event is set."""
        stop, ready = threading.Event(), threading.Barrier(3)

        def hold():
            torch.set_num_threads(team)
            a = torch.randn(256, 256)
            for _ in range(5):
                a @ a
            ready.wait()
            stop.wait()

        for _ in range(2):
            threading.Thread(target=hold, daemon=True).start()
        ready.wait()
        torch.set_num_threads(threads)  # the holders' calls also set the process-wide default
        return stop

    settings = ("alone", "two idle threads, one-thread teams", "two idle threads, two-thread teams")
    times: dict[str, list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        times[settings[0]] += timed()
        for team, setting in ((1, settings[1]), (2, settings[2])):
            stop = holders(team)
            times[setting] += timed()
            stop.set()
            time.sleep(0.2)  # the holders exit; their teams go with them
    rows = [{"setting": s, "median_ms": round(statistics.median(t), 2), "min_ms": round(min(t), 2)}
            for s, t in times.items()]
    for r in rows:
        print(f"{r['setting']:<40} median {r['median_ms']:8.2f} ms  min {r['min_ms']:8.2f} ms")
    common.write_json((Path(args.out) if args.out else common.RESULTS_DIR) / "omp_teams.json",
                      {"machine": common.machine_info(), "model": args.model, "caller_threads": threads,
                       "cores": cores(), "parallel_info": torch.__config__.parallel_info().splitlines()[:8],
                       "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
