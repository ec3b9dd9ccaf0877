"""How many copies of its weights a compiled model holds once its tiers have landed, beside the model itself.

    .venv/bin/python benchmarks/tier_memory.py [--models resnet50,googlenet,bert_base] [--batch 1]

Each (model, mode) in a fresh spawned process, resident memory read at three points (VmRSS, and apart its
anonymous pages, RssAnon, the process's own memory, and RssFile, pages of files it maps): ``libraries`` (torch,
opweave, ONNX Runtime, onnx, onnxscript and Inductor imported, so their code is not counted as the model's),
``model`` (the model made, its weights in memory), ``built`` (for ``eager``: 20 calls made; for ``opweave default``:
compiled, its tier builds waited for and their races decided by calls; for ``onnxruntime``, the peer of
benchmarks/cpu_latency.py, ONNX Runtime's session of the whole model as a user makes it, 20 calls made; then
``gc.collect()`` and glibc's ``malloc_trim``, so memory freed is given back and what remains is what is held).
``held`` = the default's ``built - model`` less eager's (what running the model takes either way: activations,
pools), in anonymous pages, in copies of the weights: the copies the compiled model holds besides the model's own;
the peer's the same way, so that what an engine holds of its own (its kernels' packed weights, its arena, its
thread pools) shows beside what the compiled model holds. Mapped files are reported apart: an
AOTInductor package's shared library holds its constants and stays mapped once loaded (PyTorch does not unload it
when the package is dropped), pages the kernel may drop at any time and would read again from the file.
Writes ``benchmarks/results/tier_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

import _common as common

RESULTS = Path(__file__).parent / "results"
MODES = ("eager", "opweave default", "onnxruntime")


def rss_mb() -> dict[str, float]:
    """Resident MiB: ``rss`` in all, ``anon`` (the process's own pages) and ``file`` (pages of files it maps)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":")[0]
        if name in keys:
            out[keys[name]] = round(int(line.split()[1]) / 1024, 1)
    return out


def trimmed_mb() -> dict[str, float]:
    """Resident memory once the garbage is collected and glibc gives back what it freed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return rss_mb()


def child(name: str, batch: int, mode: str, cache: str, conn) -> None:
    os.environ["OPWEAVE_CACHE_DIR"] = cache
    import onnx  # noqa: F401 - libraries loaded before the first reading
    import onnxruntime  # noqa: F401
    import onnxscript  # noqa: F401
    import torch
    import torch._inductor  # noqa: F401

    import opweave
    from opweave import zoo

    libraries = trimmed_mb()
    model, inputs = zoo.create(name, batch_size=batch)
    model.eval()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    made = trimmed_mb()
    row = {"model": name, "batch": batch, "mode": mode, "weights_mb": round(weights, 1)}
    with torch.inference_mode():
        if mode == "eager":
            for _ in range(20):
                model(*inputs)
        elif mode == "onnxruntime":
            from cpu_latency import onnxruntime_session

            peer = onnxruntime_session(model, inputs, parallel=False)
            for _ in range(20):
                peer(*inputs)
        else:
            fast = opweave.compile(model, inputs)
            fast.wait()
            for _ in range(200):
                if not fast.backend.racing:
                    break
                fast(*inputs)
            for _ in range(20):
                fast(*inputs)
            row.update(tier=fast.backend.label, tiers=[{k: t.get(k) for k in ("kind", "landed", "cached")}
                                                       for t in fast.backend.tiers])
    row.update(libraries_mb=libraries, model_mb=made, built_mb=trimmed_mb())
    conn.send(row)
    conn.close()


def measure(name: str, batch: int, mode: str, cache: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child, args=(name, batch, mode, cache, send))
    process.start()
    send.close()
    row = receive.recv()
    process.join()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,googlenet,bert_base")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--stem", default="tier_memory")
    args = p.parse_args(argv)
    import tempfile

    machine = common.machine_info()
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="opweave-tier-memory-") as cache:
        for name in args.models.split(","):
            eager, default, peer = (measure(name, args.batch, mode, cache) for mode in MODES)
            rows += [eager, default, peer]
            def beyond(kind: str, row: dict) -> float:
                return row["built_mb"][kind] - row["model_mb"][kind]

            run_eager = beyond("anon", eager)
            extra = beyond("anon", default) - run_eager
            files = beyond("file", default) - beyond("file", eager)
            peer_extra = beyond("anon", peer) - run_eager
            summary.append({"model": name, "batch": args.batch, "weights_mb": default["weights_mb"],
                            "tier": default["tier"], "eager_run_mb": round(run_eager, 1),
                            "compiled_extra_mb": round(extra, 1),
                            "held_copies": round(extra / default["weights_mb"], 2),
                            "peer_extra_mb": round(peer_extra, 1),
                            "peer_copies": round(peer_extra / default["weights_mb"], 2),
                            "file_mb": round(files, 1)})
            common.console.print(summary[-1])
    command = "python benchmarks/tier_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"command": command.strip(), "machine": machine, "rows": rows, "summary": summary}
    common.write_json(RESULTS / f"{args.stem}.json", data)
    lines = ["# Copies of the weights a compiled model holds", "",
             f"`{data['command']}` — {machine['date']}, torch {machine['torch']}", "",
             "Resident MiB of the process's own memory (anonymous pages) once built, its tiers landed, garbage "
             "collected and freed memory given back; beyond the model's own weights and what running it eagerly "
             "takes. Pages of files it maps (a loaded library's, an AOTInductor package's code and constants, "
             "which stay mapped once loaded) apart: the kernel drops them when memory is short and reads them "
             "again if they are used. Beside it, ONNX Runtime's session of the whole model as a user makes it (the "
             "peer of benchmarks/cpu_latency.py), measured the same way.", "",
             "| model | batch | weights MiB | tier in use | eager's run MiB | compiled beyond it MiB | copies held "
             "| mapped files MiB | ONNX Runtime whole beyond it MiB | its copies |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['model']} | {s['batch']} | {s['weights_mb']} | {s['tier']} | {s['eager_run_mb']} | "
                     f"{s['compiled_extra_mb']} | {s['held_copies']:.2f} | {s['file_mb']} | {s['peer_extra_mb']} | "
                     f"{s['peer_copies']:.2f} |")
    (RESULTS / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
