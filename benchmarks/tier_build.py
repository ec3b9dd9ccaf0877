"""How much a model's calls slow down while one of its later tiers is built beside them.

    .venv/bin/python benchmarks/tier_build.py [--models googlenet,resnet50,randwire] [--batch 1] [--rounds 2]

The CPU default answers on its first tier and builds its later tiers (:mod:`opweave.pipeline.tiers`) in a build
process at a lower priority, on the same cores. Per model: the first tier alone (``opweave.compile(model, inputs,
tiers=False)``), then per round and per kind of tier (``onnxruntime-fixed``, ``inductor``) its calls timed back to
back, first with nothing else running (``quiet``), then while that tier is built and loaded (``building``:
:func:`opweave.pipeline.tiers.built_now` in a thread, in a fresh cache, so each round builds anew; the calls run on
the caller's thread as a user's would), then quiet again. Every call made is timed; the ratio compares the median call
while building with the median of the quiet calls of the same round. Writes ``benchmarks/results/tier_build.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common as common

RESULTS = Path(__file__).parent / "results"


def _decile(times: list[float], which: int) -> float:
    return statistics.quantiles(times, n=10)[which - 1] if len(times) >= 2 else times[0]


def calls(fast, inputs, *, count: int | None = None, while_alive: threading.Thread | None = None) -> list[float]:
    """Call times (ms): ``count`` calls, or calls until ``while_alive`` ends."""
    import torch

    out: list[float] = []
    with torch.inference_mode():
        while (count is not None and len(out) < count) or (while_alive is not None and while_alive.is_alive()):
            start = time.perf_counter()
            fast(*inputs)
            out.append((time.perf_counter() - start) * 1e3)
    return out


def measure(name: str, batch: int, rounds: int, quiet_calls: int, kinds: list[str]) -> list[dict]:
    import torch

    import opweave
    from opweave import zoo
    from opweave.pipeline import tiers

    model, inputs = zoo.create(name, batch_size=batch)
    model.eval()
    fast = opweave.compile(model, inputs, tiers=False)
    calls(fast, inputs, count=5)  # untimed: pools and caches warm
    rows = []
    for r in range(rounds):
        for kind in kinds:
            before = calls(fast, inputs, count=quiet_calls)
            with tempfile.TemporaryDirectory(prefix="opweave-tier-bench-") as cache:
                os.environ["OPWEAVE_CACHE_DIR"] = cache
                failed: list[str] = []

                def build():
                    try:
                        tiers.built_now(kind, fast.captured, inputs, fast.options)  # noqa: B023 - run at once
                    except Exception as exc:  # noqa: BLE001 - reported in the row
                        failed.append(str(exc)[:200])  # noqa: B023

                builder = threading.Thread(target=build)
                start = time.perf_counter()
                builder.start()
                during = calls(fast, inputs, while_alive=builder)
                builder.join()
                seconds = time.perf_counter() - start
            after = calls(fast, inputs, count=quiet_calls)
            quiet = before + after
            row = {"model": name, "batch": batch, "round": r, "kind": kind, "first_tier": fast.choice["label"],
                   "build_s": round(seconds, 2), "failed": failed[0] if failed else None,
                   "quiet_ms": round(statistics.median(quiet), 3), "quiet_p90_ms": round(_decile(quiet, 9), 3),
                   "building_ms": round(statistics.median(during), 3),
                   "building_p90_ms": round(_decile(during, 9), 3), "building_calls": len(during),
                   "threads": torch.get_num_threads()}
            row["slowdown"] = round(row["building_ms"] / row["quiet_ms"], 3)
            rows.append(row)
            common.console.print(f"{name} b{batch} round {r} {kind}: quiet {row['quiet_ms']} ms, while building "
                                 f"{row['building_ms']} ms ({row['slowdown']}x, {len(during)} calls, "
                                 f"{row['build_s']} s)")
    fast.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["model"], r["batch"], r["kind"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["batch"], r["kind"]) == key]
        out.append({"model": key[0], "batch": key[1], "kind": key[2],
                    "slowdown": round(statistics.median(r["slowdown"] for r in mine), 3),
                    "slowdown_range": [min(r["slowdown"] for r in mine), max(r["slowdown"] for r in mine)],
                    "build_s": round(statistics.median(r["build_s"] for r in mine), 1)})
    return out


def markdown(data: dict) -> str:
    lines = ["# Calls while a tier is built beside them", "",
             f"`{data['command']}` — {data['machine']['date']}, torch {data['machine']['torch']}, "
             f"{data['machine']['cpus_usable']} cores, load average before {data['machine']['load_average_1_5_15m']}, "
             f"the build process at niceness {data['build_nice']}",
             "", "Median call of the first tier while the tier is built (in its build process, at a lower priority) "
             "against the median of the quiet calls of the same round; p90 in brackets.", "",
             "| model | batch | round | tier built | build s | quiet ms | while building ms | slowdown | calls |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['round']} | {r['kind']}{' (failed)' if r['failed'] else ''}"
                     f" | {r['build_s']} | {r['quiet_ms']} ({r['quiet_p90_ms']}) | {r['building_ms']} "
                     f"({r['building_p90_ms']}) | {r['slowdown']:.2f}x | {r['building_calls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="googlenet,resnet50,randwire")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quiet-calls", type=int, default=30, help="timed calls before and after each build")
    p.add_argument("--kinds", default="onnxruntime-fixed,inductor")
    p.add_argument("--stem", default="tier_build")
    args = p.parse_args(argv)
    machine = common.machine_info()
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args.batch, args.rounds, args.quiet_calls, args.kinds.split(","))
    command = "python benchmarks/tier_build.py " + " ".join(argv if argv is not None else sys.argv[1:])
    from opweave.pipeline.tiers import BUILD_NICE

    data = {"command": command.strip(), "machine": machine, "build_nice": BUILD_NICE, "rows": rows,
            "summary": summarize(rows)}
    common.write_json(RESULTS / f"{args.stem}.json", data)
    (RESULTS / f"{args.stem}.md").write_text(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
