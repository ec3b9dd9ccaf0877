"""The serving peer of ``benchmarks/serving.py``: the same zoo models served by Ray Serve, as a user would without
opweave: one deployment per model running the eager PyTorch module, Ray Serve's dynamic batching
(``@serve.batch``), behind a FastAPI ingress that speaks the same KServe v2 routes as ``opweave serve`` (model
metadata and ``infer``, JSON or binary tensors; requests decoded and answered with :mod:`opweave.serve.protocol`, so
the load generator sends both servers the same bytes).

    .venv/bin/python benchmarks/ray_peer.py --models squeezenet --port 8123     # serves until interrupted

Ray runs on 127.0.0.1 only (``ray.init(_node_ip_address="127.0.0.1")``, no dashboard), started and stopped by
:class:`RayPeer`. Each deployment gets ``cores / models`` intra-op threads (at least 1), so the replicas together
use the cores once, as opweave's lanes do; the ingress gets no CPU reservation. ``wait_ms`` is
``@serve.batch``'s ``batch_wait_timeout_s`` (the benchmark tunes it: see ``serving.py``).

(No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations, and as strings it cannot
resolve ``Request`` inside the function that defines them.)
"""


import argparse
import os
import signal
import socket
import subprocess
import sys
import time

MAX_BATCH = 16


def build_app(models: list[str], image_size: dict | None, max_batch: int, wait_ms: float, threads: int):
    """The Ray Serve application: an ingress deployment and one deployment per model."""
    import torch
    from fastapi import FastAPI, Request, Response
    from ray import serve

    from opweave.serve.assemble import load_models
    from opweave.serve.protocol import HEADER, ProtocolError, decode, encode, metadata

    app = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Model:
        def __init__(self, name: str):
            from torch.utils import _pytree as pytree

            from opweave import zoo

            torch.set_num_threads(threads)
            size = (image_size or {}).get(name, (image_size or {}).get("*"))
            kwargs = {"image_size": size} if size and zoo.takes_image_size(name) else {}
            self.module = zoo.create(name, batch_size=1, **kwargs)[0].eval()
            self.pytree = pytree

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_ms / 1e3)
        async def infer(self, requests: list[tuple]) -> list[list[torch.Tensor]]:
            sizes = [r[0].shape[0] for r in requests]
            batched = [torch.cat(column) for column in zip(*requests, strict=True)]
            with torch.inference_mode():
                out = self.module(*batched)
            leaves = self.pytree.tree_leaves(out)
            pieces = [torch.split(leaf, sizes) for leaf in leaves]
            return [[p[i] for p in pieces] for i in range(len(requests))]

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Ingress:
        def __init__(self, handles: dict):
            self.handles = handles
            self.served = load_models(models, device="cpu", max_batch=max_batch, image_size=image_size)

        @app.get("/v2/models/{name}")
        async def model_metadata(self, name: str):
            if name not in self.served:
                return Response(status_code=404)
            return metadata(self.served[name])

        @app.post("/v2/models/{name}/infer")
        async def infer(self, name: str, request: Request):
            if name not in self.served:
                return Response(status_code=404)
            model = self.served[name]
            try:
                decoded = decode(model, await request.body(), request.headers.get(HEADER))
            except ProtocolError as exc:
                return Response(str(exc), status_code=400)
            leaves = await self.handles[name].infer.remote(decoded.inputs)
            body, headers = encode(model, decoded, leaves)
            return Response(body, headers=headers)

    return Ingress.bind({name: Model.options(name=f"model-{name}").bind(name) for name in models})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayPeer:
    """Ray Serve with the peer app in a child process on 127.0.0.1; ``url`` once it answers; ``stop()`` ends it."""

    def __init__(self, models: list[str], image_size: str | None, wait_ms: float, max_batch: int = MAX_BATCH,
                 timeout_s: float = 600.0):
        port = free_port()
        cmd = [sys.executable, __file__, "--models", ",".join(models), "--port", str(port), "--wait-ms",
               str(wait_ms), "--max-batch", str(max_batch)]
        if image_size:
            cmd += ["--image-size", image_size]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.proc.stdout.readline()
            if "ray peer ready" in line:
                break
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the Ray Serve peer did not start (exit {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM: shut Ray down as on Ctrl-C


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--image-size", default=None)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    args = p.parse_args()
    import ray
    from ray import serve

    from opweave.cores import cores
    from opweave.serve.assemble import parse_image_size

    models = args.models.split(",")
    threads = max(1, cores() // len(models))
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=cores(),
             log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(models, parse_image_size(args.image_size), args.max_batch, args.wait_ms, threads),
              route_prefix="/", blocking=False)
    print("ray peer ready", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
