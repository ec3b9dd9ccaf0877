"""A server meeting new batch sizes while steady traffic runs: what the steady requests' tail pays, what each new size's
first request costs, and whether every answer equals the model run eagerly.

    .venv/bin/python benchmarks/serve_sizes.py [--models squeezenet,bert_base] [--sizes 2-13] [--lengths L,...]
                                               [--alone-s 15] [--calls 3] [--stem serve_sizes]
    .venv/bin/python benchmarks/serve_sizes.py --quick      # sizes 2-4, 5 s alone

For each model of ``--models``: ``opweave export MODEL --max-batch N`` (random weights) into a repository, served by
``opweave serve --model-repository REPO --device cpu --max-batch N`` with the defaults otherwise, a child process on
127.0.0.1 (started fresh per model). A model of :data:`LENGTHS` (BERT, 2 layers, exported at 32 tokens with its length
free, ``--free-dim input_ids:1=2-128``) sweeps sequence lengths at batch 1 instead of batch sizes (``--lengths``:
the lengths ``new_signature.py`` sweeps). One client thread sends the model's batch-1 request (of the exported
length) over HTTP (binary inputs), one after the other:

* **alone**: for ``--alone-s`` seconds, nothing else running (after 20 untimed requests): its latencies;
* **sweep**: while that client goes on, a second client sends each batch size of ``--sizes`` in turn (each new to
  the server: ``first_ms``), then ``--calls`` more at that size (``steady_ms``, their median; ``ratio`` = first over
  steady); the steady client's latencies from the sweep's first request to its last answer are ``during``;
* **repeat**: the same sweep again, every size served before: the same load without anything new
  (``during_repeat``);
* **after**: ``--alone-s`` seconds alone again (the machine's load may have moved: both alone phases are reported).

``p99_ratio`` is the steady client's 99th percentile during the sweep over its 99th percentile alone (before);
``p99_ratio_vs_repeat`` over its 99th percentile during the repeat: what the sizes being new cost the steady
traffic, beside what their work on the shared cores costs it.
Every answer (steady and swept) is held against the exported program run eagerly on the same inputs
(:func:`opweave.outputs.compare`): ``all_equal_eager``.

Writes ``DIR/STEM.json`` and ``DIR/STEM.md``. The figures depend on the machine and on what else runs on it
(``load_average`` per model, ``machine.load_average_1_5_15m`` at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common as common
import torch
from serve_many import Reference, percentiles, start, stop
from torch.utils import _pytree as pytree

from opweave.serve.protocol import HEADER

QUICK_SIZES = "2-4"
# Models swept over sequence lengths: their zoo options, the length exported free and its range.
LENGTHS = {"bert_base": ({"num_layers": 2, "seq_len": 32}, "input_ids:1=2-128")}
SWEPT_LENGTHS = "64,16,24,40,48,8,12,20,28,56,96,128"  # new_signature.py's (compiled at 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="squeezenet,bert_base", help="comma list of zoo models (default %(default)s)")
    p.add_argument("--sizes", default="2-13", help="batch sizes swept, A-B or a comma list (default %(default)s)")
    p.add_argument("--lengths", default=SWEPT_LENGTHS, help="sequence lengths swept for a model of LENGTHS "
                                                            "(default %(default)s)")
    p.add_argument("--max-batch", type=int, default=16, help="the config's max_batch_size (default %(default)s)")
    p.add_argument("--alone-s", type=float, default=15.0, help="seconds of steady traffic alone (default %(default)s)")
    p.add_argument("--calls", type=int, default=3, help="requests per size after its first (default %(default)s)")
    p.add_argument("--stem", default="serve_sizes", help="file name without suffix (default %(default)s)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 s alone, 1 call per size")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.alone_s, args.calls = QUICK_SIZES, 5.0, 1
        args.lengths = ",".join(args.lengths.split(",")[:3])
    return args


def sizes_of(text: str) -> list[int]:
    if "-" in text:
        low, high = (int(x) for x in text.split("-"))
        return list(range(low, high + 1))
    return [int(x) for x in text.split(",") if x]


class Sized(Reference):
    """The exported model's request at ``batch`` samples (seeded random inputs; ``length``: dimension 1 of every
    input that long, token ids drawn below the example's largest) and what the program answers."""

    def __init__(self, entry: Path, batch: int, seed: int, length: int | None = None):
        super().__init__(entry)
        generator = torch.Generator().manual_seed(seed)
        inputs = []
        for name, datatype, x in self.inputs:
            shape = (batch, *x.shape[1:]) if length is None else (batch, length, *x.shape[2:])
            if x.dtype.is_floating_point:
                value = torch.randn(shape, generator=generator).to(x.dtype)
            elif length is None:
                value = x.expand(shape).contiguous()
            else:
                value = torch.randint(0, int(x.max()) + 1, shape, generator=generator).to(x.dtype)
            inputs.append((name, datatype, value))
        self.inputs = inputs
        with torch.no_grad():  # sample by sample: the program was exported at batch 1
            rows = [pytree.tree_leaves(self.module(*[x[i:i + 1] for _, _, x in self.inputs])) for i in range(batch)]
        self.expected = [torch.cat(column) for column in zip(*rows, strict=True)]
        self.payload = self.body()

    def body(self) -> tuple[bytes, dict]:
        """The request, its outputs asked for as binary data (tritonclient's default): a long sequence's output in
        JSON took tens of milliseconds to write in the server and to read in this process, either of which held up
        the other client's requests beside it."""
        text, headers = super().body()
        size = int(headers[HEADER])
        head = json.loads(text[:size])
        head["outputs"] = [{"name": f"output__{i}", "parameters": {"binary_data": True}}
                           for i in range(len(self.expected))]
        encoded = json.dumps(head).encode()
        return encoded + text[size:], {**headers, HEADER: str(len(encoded))}


def infer(client, url: str, name: str, payload: tuple[bytes, dict]) -> tuple[float, list]:
    """One request whose outputs come as binary data; its latency (ms) and output tensors."""
    from opweave.serve.models import DTYPES

    begin = time.perf_counter()
    reply = client.post(f"{url}/v2/models/{name}/infer", content=payload[0], headers=payload[1])
    ms = (time.perf_counter() - begin) * 1e3
    reply.raise_for_status()
    size = int(reply.headers[HEADER])
    outputs, at = [], size
    for o in json.loads(reply.content[:size])["outputs"]:
        n = o["parameters"]["binary_data_size"]
        dtype = DTYPES[o["datatype"]]
        outputs.append(torch.frombuffer(bytearray(reply.content[at:at + n]), dtype=dtype).reshape(o["shape"]))
        at += n
    return ms, outputs


class Steady(threading.Thread):
    """One client sending ``ref``'s request one after the other until stopped: each answer's end time, latency and
    whether it equals eager."""

    def __init__(self, url: str, name: str, ref: Reference):
        super().__init__(daemon=True)
        self.url, self.name, self.ref = url, name, ref
        self.stop, self.times, self.right = threading.Event(), [], True

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                ms, out = infer(client, self.url, self.name, self.ref.payload)
                self.times.append((time.perf_counter(), ms))
                self.right = self.right and self.ref.equal(out)


def one_size(client, url: str, model: str, n: int, ref: Reference, calls: int) -> dict:
    """Size ``n``'s request once (``first_ms``), then ``calls`` times more (their median, ``steady_ms``); whether
    every answer equals eager."""
    first_ms, out = infer(client, url, model, ref.payload)
    right, again = ref.equal(out), []
    for _ in range(calls):
        ms, out = infer(client, url, model, ref.payload)
        again.append(ms)
        right = right and ref.equal(out)
    median = statistics.median(again)
    return {"size": n, "first_ms": first_ms, "steady_ms": median, "ratio": first_ms / median, "equal_to_eager": right}


def one_model(model: str, args) -> dict:
    import httpx

    lengths = model in LENGTHS
    sizes = sizes_of(args.lengths if lengths else args.sizes)
    with tempfile.TemporaryDirectory() as tmp:
        if lengths:
            from opweave import zoo
            from opweave.serve.repository.export import export, parse_free_dims

            options, free = LENGTHS[model]
            made, example = zoo.create(model, **options)
            export(made, example, tmp, model, max_batch=args.max_batch, free=parse_free_dims([free]))
        else:
            subprocess.run([sys.executable, "-m", "opweave", "export", model, tmp, "--max-batch",
                            str(args.max_batch)], check=True, capture_output=True)
        entry = next(p for p in Path(tmp).iterdir() if p.is_dir() and not p.name.startswith("."))
        steady_ref = Sized(entry, 1, seed=0)
        swept = {n: Sized(entry, 1, seed=n, length=n) if lengths else Sized(entry, n, seed=n) for n in sizes}
        load_average = os.getloadavg()
        proc, url, ready_s = start(Path(tmp), ["--max-batch", str(args.max_batch)], "cpu")
        try:
            with httpx.Client(timeout=120) as client:
                for _ in range(20):
                    infer(client, url, model, steady_ref.payload)
            steady = Steady(url, model, steady_ref)
            steady.start()
            t0 = time.perf_counter()
            time.sleep(args.alone_s)
            t1 = time.perf_counter()
            with httpx.Client(timeout=120) as client:
                rows = [one_size(client, url, model, n, swept[n], args.calls) for n in sizes]
                t2 = time.perf_counter()  # the same sweep again: every size served before, the same load
                repeat = [one_size(client, url, model, n, swept[n], args.calls) for n in sizes]
            t3 = time.perf_counter()
            time.sleep(args.alone_s)
            t4 = time.perf_counter()
            steady.stop.set()
            steady.join(120)
        finally:
            stop(proc)

    def window(begin: float, end: float) -> dict:
        return percentiles([ms for done, ms in steady.times if begin < done <= end])

    alone, during, repeated, after = window(t0, t1), window(t1, t2), window(t2, t3), window(t3, t4)
    return {"model": model, "swept": "length" if lengths else "batch", "load_average": load_average,
            "ready_s": ready_s, "alone": alone, "during": during, "during_repeat": repeated, "after": after,
            "p99_ratio": during["p99_ms"] / alone["p99_ms"],
            "p99_ratio_vs_repeat": during["p99_ms"] / repeated["p99_ms"],
            "p99_ratio_after": during["p99_ms"] / after["p99_ms"], "sizes": rows,
            "first_over_steady_median": statistics.median(r["ratio"] for r in rows),
            "first_over_steady_max": max(r["ratio"] for r in rows),
            "all_equal_eager": steady.right and all(r["equal_to_eager"] for r in rows + repeat)}


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [f"# New sizes sent to a server beside steady traffic ({m['cpus_usable']}-core CPU, torch "
             f"{m['torch']}, {m['date'][:16].replace('T', ' ')} UTC)", "",
             "Steady: batch-1 requests (of the exported length) one after the other; its p99 alone, during the "
             "sweep of new sizes, during the same sweep repeated (nothing new), and alone again after. Each new "
             "size: its first request over the median of the requests after it.", "",
             "| model | swept | steady p99 alone / during / repeat / after ms | during over alone | during over "
             "repeat | new size first / steady: median, largest | answers equal eager |",
             "|---|---|---|---|---|---|---|"]
    for r in data["models"]:
        sizes = sorted(s["size"] for s in r["sizes"])
        swept = f"{len(sizes)} {r.get('swept', 'batch')}s {sizes[0]}-{sizes[-1]}"
        lines.append(f"| {r['model']} | {swept} | {r['alone']['p99_ms']:.1f} / "
                     f"{r['during']['p99_ms']:.1f} / {r['during_repeat']['p99_ms']:.1f} / {r['after']['p99_ms']:.1f} | "
                     f"{r['p99_ratio']:.2f}x | {r['p99_ratio_vs_repeat']:.2f}x | "
                     f"{r['first_over_steady_median']:.2f}x, "
                     f"{r['first_over_steady_max']:.2f}x | {r['all_equal_eager']} |")
    lines += ["", "Per size, in the order sent (ms):", "", "| model | size | first | steady | ratio | equal |",
              "|---|---|---|---|---|---|"]
    for r in data["models"]:
        for s in r["sizes"]:
            size = f"{r.get('swept', 'batch')} {s['size']}"
            lines.append(f"| {r['model']} | {size} | {s['first_ms']:.1f} | {s['steady_ms']:.1f} | "
                         f"{s['ratio']:.2f} | {s['equal_to_eager']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = []
    for model in [m for m in args.models.split(",") if m]:
        swept = f"lengths {args.lengths}" if model in LENGTHS else f"batch sizes {args.sizes}"
        common.console.print(f"{model}: {swept} beside steady traffic ...")
        models.append(one_model(model, args))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    data = {"machine": common.machine_info(), "settings": settings, "models": models}
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{args.stem}.json", data)
    text = markdown(data)
    (args.out / f"{args.stem}.md").write_text(text)
    common.console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
