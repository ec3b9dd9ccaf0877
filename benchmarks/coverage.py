"""Third-party model coverage: which models from torchvision, timm and transformers opweave compiles and runs equal to
eager on the CPU, under which schedulers, and what capture and compilation cost.

    .venv/bin/python benchmarks/coverage.py [--quick] [--models a,b] [--schedulers x,y] [--out DIR]

Models and schedulers: ``opweave.evaluate.coverage.MODELS`` (random weights, small configurations; see that module for
the choices) and ``opweave.evaluate.coverage.SCHEDULERS`` unless ``--models``/``--schedulers`` say otherwise;
``--quick`` takes the first model of each library. For each model the table shows its op count, the capture time (once
per model), the compile time per scheduler (schedule + lower + validate + backend; the CPU backend) and "pass" or the
first line of the first error. A scheduler passes when the compiled model equals eager
(``opweave.evaluate.coverage.TOLERANCE``) on the example input and on a second random input. One intra-op thread, as in
the test suite. Times are wall times on a shared machine: noisy, single runs. Writes ``DIR/coverage.json`` and the table
as ``DIR/coverage.md``.
"""

from __future__ import annotations

import _common as common
import torch

from opweave.evaluate import coverage


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    names = common.split_names(args.models, list(coverage.MODELS), "model") or list(coverage.MODELS)
    if args.quick and not args.models:
        names = [next(n for n in names if n.startswith(prefix)) for prefix in ("torchvision:", "timm:", "hf:")]
    schedulers = (common.split_names(args.schedulers, [*coverage.SCHEDULERS, "default"], "scheduler")
                  or coverage.SCHEDULERS)
    torch.set_num_threads(1)
    watch = common.Stopwatch()
    rows = []
    with common.progress() as bar:
        task = bar.add_task("coverage", total=len(names))
        for name in names:
            bar.update(task, description=name)
            rows.append(coverage.check(name, tuple(schedulers)))
            bar.advance(task)
    cells, passed = [], 0
    for row in rows:
        results = row["schedulers"]
        ok = [s for s in schedulers if s in results and results[s]["error"] is None]
        passed += len(ok)
        first = row["error"] or next((f"{s}: {results[s]['error']}" for s in schedulers
                                      if s in results and results[s]["error"]), None)
        cells.append([row["model"], str(row["ops"] or ""),
                      "" if row["capture_s"] is None else f"{row['capture_s']:.2f}",
                      *(f"{results[s]['compile_s']:.3f}" if results.get(s, {}).get("compile_s") is not None else "-"
                        for s in schedulers),
                      "pass" if first is None else first[:120]])
    total = len(rows) * len(schedulers)
    summary = (f"{passed}/{total} model x scheduler pairs pass; "
               f"{sum(1 for r in rows if not r['error'] and all(v['error'] is None for v in r['schedulers'].values()))}"
               f"/{len(rows)} models pass under every scheduler")
    common.console.print(common.table(
        "opweave on third-party models (CPU, random weights): ops, capture s, compile s per scheduler, result",
        ["model", "ops", "capture s", *(f"{s} s" for s in schedulers), "result"], cells, caption=summary))
    header = ["model", "ops", "capture s", *(f"{s} s" for s in schedulers), "result"]
    lines = ["# opweave on third-party models", "", "Written by `benchmarks/coverage.py` (CPU, random weights, one "
             f"intra-op thread, torch {torch.__version__}); single wall-time runs on a shared machine.", "",
             f"**{summary}.**", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cell) + " |" for cell in cells]
    (args.out / "coverage.md").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "coverage.md").write_text("\n".join(lines) + "\n")
    common.write_json(args.out / "coverage.json", {
        "machine": common.machine_info(),
        "settings": {"quick": args.quick, "schedulers": list(schedulers), "tolerance": coverage.TOLERANCE,
                     "intra_op_threads": 1},
        "summary": {"models": len(rows), "schedulers": len(schedulers), "pairs_passed": passed, "pairs": total},
        "results": rows,
        "wall_time_s": watch.elapsed_s,
    })


if __name__ == "__main__":
    main()
