"""Bring what one GPU check plan wrote (scripts/gpu_check.sh, its ``$OUT``) into ``benchmarks/results/``, named after
the device, the date and the plan, and say what it measured.

    .venv/bin/python scripts/gpu_ingest.py DIR PLAN --commit SHA [--note "what cut it short"] [--results DIR]

From ``DIR``: the results JSON of ``benchmarks/gpu_latency.py`` (``<device>-<date>.json``) becomes
``gpu_latency_<gpu>_<date>_<PLAN>.json`` with the commit measured and the command that ran it after its date (one
space of indent, as the committed files are); ``junit*.xml`` become ``gpu_junit_<gpu>_<date>_<PLAN>[-more].xml``;
``gpu_check.log`` becomes ``gpu_check_<gpu>_<date>_<PLAN>.log``; any other JSON (``new_signature_cuda.json``,
``serving_gpu.json``, ``profiles.json``, ``decode_cuda_*.json``) ``<stem>_<gpu>_<date>_<PLAN>.json``. A file
already there is refused, not overwritten. Then it prints, per configuration, the best opweave mode against the
sequential CUDA Graph and torch.compile (the acceptance figures of docs/gpu.md), the tests that failed, and the
commands that come next: the simulator scored on the new rows before any refit, the refit, the fit's report. Nothing
needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the directory the plan wrote ($OUT)")
    p.add_argument("plan", help="the plan that ran (lease5, lease6, ...)")
    p.add_argument("--commit", required=True, help="the commit the machine ran")
    p.add_argument("--note", default="", help="what to add to the command (e.g. which stage a limit cut short)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the files go (default %(default)s)")
    return p.parse_args(argv)


def gpu_slug(device: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the model name, lower case (the committed files' prefix)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.lower() not in ("nvidia", "sxm", "sxm5", "pcie")]
    return words[0].lower() if words else "gpu"


def with_provenance(data: dict, commit: str, command: str) -> dict:
    """``data`` with ``commit`` and ``command`` right after ``date`` (replacing any it had)."""
    out: dict = {}
    for key, value in data.items():
        if key in ("commit", "command"):
            continue
        out[key] = value
        if key == "date":
            out["commit"], out["command"] = commit, command
    return out


def ingest(out: Path, plan: str, commit: str, note: str = "", results: Path = RESULTS) -> list[Path]:
    """Copy what ``out`` holds into ``results`` (module docstring); the paths written."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", plan):
        raise SystemExit(f"gpu_ingest: plan must be a plain name, got {plan!r}")
    bench = [p for p in sorted(out.glob("*.json")) if {"results", "summaries"} <= set(json.loads(p.read_text()))]
    if len(bench) > 1:
        raise SystemExit(f"gpu_ingest: more than one results file in {out}: {', '.join(p.name for p in bench)}")
    data = json.loads(bench[0].read_text()) if bench else None
    device = data["device"] if data else _device_from_log(out / "gpu_check.log")
    date = (data["date"] if data else _date_from_log(out / "gpu_check.log"))[:10]
    gpu = gpu_slug(device)
    command = f"OUT=$OUT scripts/gpu_check.sh {plan}" + (f" ({note})" if note else "")
    plans: list[tuple[Path, Path, str | None]] = []  # source, destination, new text (None: copied as it is)
    if data is not None:
        text = json.dumps(with_provenance(data, commit, command), indent=1) + "\n"
        plans.append((bench[0], results / f"gpu_latency_{gpu}_{date}_{plan}.json", text))
    for junit in sorted(out.glob("junit*.xml")):
        suffix = junit.stem.removeprefix("junit")  # "" or "-more"
        plans.append((junit, results / f"gpu_junit_{gpu}_{date}_{plan}{suffix}.xml", None))
    if (out / "gpu_check.log").exists():
        plans.append((out / "gpu_check.log", results / f"gpu_check_{gpu}_{date}_{plan}.log", None))
    for other in sorted(out.glob("*.json")):
        if other not in bench:
            plans.append((other, results / f"{other.stem}_{gpu}_{date}_{plan}.json", None))
    there = [str(dest.relative_to(results)) for _, dest, _ in plans if dest.exists()]
    if there:
        raise SystemExit(f"gpu_ingest: already in {results}, not overwritten: {', '.join(there)}")
    for source, dest, text in plans:
        if text is None:
            shutil.copyfile(source, dest)
        else:
            dest.write_text(text)
    return [dest for _, dest, _ in plans]


def _device_from_log(log: Path) -> str:
    found = re.search(r"NVIDIA [A-Z]\d+\w*", log.read_text()) if log.exists() else None
    return found.group(0) if found else "gpu"


def _date_from_log(log: Path) -> str:
    found = re.search(r"\d{4}-\d\d-\d\d", log.read_text()) if log.exists() else None
    if not found:
        raise SystemExit(f"gpu_ingest: no results file and no date in {log}")
    return found.group(0)


def report(paths: list[Path]) -> str:
    """What the ingested files say: per configuration the best opweave mode against the CUDA Graph and
    torch.compile, each JUnit file's counts and failures, and the commands that come next."""
    lines = []
    for path in paths:
        if path.name.startswith("gpu_latency_"):
            lines += _speedups(json.loads(path.read_text()))
        elif path.suffix == ".xml":
            lines += _junit(path)
    new = [p for p in paths if p.name.startswith("gpu_latency_")]
    if new:
        rel = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in new]
        stem = new[0].stem.replace("gpu_latency_", "sim_gpu_heldout_")
        every = sorted({*(str(p.relative_to(ROOT)) for p in RESULTS.glob("gpu_latency_*.json")
                          if "fused" not in p.name), *rel})  # the fused run's rows are not fitted
        lines += ["", "next, before any refit (the simulator held out on the new rows):",
                  f"  .venv/bin/python benchmarks/sim_gpu_fit.py --results {','.join(rel)} --name {stem}",
                  "then the refit on every results file, and its report:",
                  f"  .venv/bin/opweave calibrate {' '.join(every)} --trace tests/data/googlenet-trace.json.gz "
                  "--out src/opweave/costs/data/h200.json --report benchmarks/results/calibrate_h200.json",
                  f"  .venv/bin/python benchmarks/sim_gpu_fit.py --results {','.join(every)} --report "
                  "benchmarks/results/calibrate_h200.json",
                  "and docs/gpu.md's tables (gpu_latency.markdown, chosen_markdown), with the new file named in "
                  "tests/test_cuda_cpu_paths.py::test_docs_gpu_shows_the_committed_results_as_they_are"]
    return "\n".join(lines)


def _speedups(data: dict) -> list[str]:
    lines = [f"{data['device']}, torch {data['torch']}, {data['date']}, commit {data.get('commit')}"]
    configs = dict.fromkeys((r["model"], r["batch_size"], r["dtype"]) for r in data["results"])
    for model, batch, dtype in configs:
        rows = [r for r in data["results"] if (r["model"], r["batch_size"], r["dtype"]) == (model, batch, dtype)]
        by_mode = {r["mode"]: r for r in rows if r.get("median_ms") is not None and r.get("ok", False)}
        ours = {m: r for m, r in by_mode.items() if m.startswith("opweave ")}
        wrong = [r["mode"] for r in rows if r.get("median_ms") is not None and not r.get("ok", False)]
        failed = [r["mode"] for r in rows if r.get("median_ms") is None]
        text = f"  {model} b{batch} {dtype}: "
        if not ours:
            text += "no opweave mode measured"
        else:
            best = min(ours.values(), key=lambda r: r["median_ms"])
            text += f"best {best['mode']} {best['median_ms']:.3f} ms"
            for peer, label in (("cuda-graph", "the CUDA Graph"), ("torch.compile", "torch.compile")):
                if peer in by_mode:
                    text += f", {by_mode[peer]['median_ms'] / best['median_ms']:.2f}x {label}"
        if wrong:
            text += f"; WRONG: {', '.join(wrong)}"
        if failed:
            text += f"; not measured: {', '.join(failed)}"
        lines.append(text)
    return lines


def _junit(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    total = failed = skipped = 0
    names = []
    for case in cases:
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            names.append(f"{case.get('classname', '')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            skipped += 1
    lines = [f"{path.name}: {total - failed - skipped} of {total} passed, {failed} failed, {skipped} skipped"]
    return lines + [f"  FAILED {name}" for name in names]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.out.is_dir():
        print(f"gpu_ingest: no directory {args.out}", file=sys.stderr)
        return 2
    paths = ingest(args.out, args.plan, args.commit, args.note, args.results)
    for path in paths:
        print(f"wrote {path}")
    print(report(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
