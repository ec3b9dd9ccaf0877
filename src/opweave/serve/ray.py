"""The serving engine as a Ray Serve deployment: N replicas, each one engine on its own device (a CPU share or a
GPU), behind Ray Serve's HTTP proxy with the same KServe v2 routes as ``opweave serve`` (the FastAPI app of
:func:`opweave.serve.server.create_app`, built inside each replica: ``@serve.ingress()`` with
``__serve_build_asgi_app__``).

    from opweave.serve import ray as opweave_ray
    url = opweave_ray.deploy(ReplicaOptions(models=["squeezenet"], image_size=64), replicas=2)  # local cluster
    opweave serve --ray --replicas 2 --models squeezenet --image-size 64 --port 8000             # the same

Each replica builds its models and engine when Ray starts it (models from the zoo, ``.pt2`` files or a model
repository directory, which every node must see at the same path), and reports itself unhealthy if its engine's
thread stops, so that Ray replaces it. ``replicas`` fixes their number; ``autoscaling`` (Ray's
``autoscaling_config``: ``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...) lets Ray choose.

What a replica's death costs. Ray Serve's proxy routes each request to one replica. A request in flight on a
replica that dies is answered by the proxy with a 5xx status (500, or 503 while no replica can take it) — never
left hanging, never answered with wrong data — and Ray starts a replacement. Inference is idempotent, so a client
that retries 5xx answers from the proxy (:func:`retrying_post` does: up to ``attempts`` times, ``backoff_s`` apart)
gets every request answered by a live replica. The survivors take the dead replica's share, so their queues may
fill: a 429 is a refusal, not a loss (the request was never accepted), and it says when to come back
(``Retry-After``); :func:`retrying_post` waits that long and tries again. "No accepted request lost" means
exactly that: every request the proxy accepted got a response, and with that retry policy every one was answered
200 with eager's outputs (``tests/test_serve_ray.py`` kills a replica process mid-load and checks it).

Ray runs on 127.0.0.1 when this module starts it (:func:`start_local`: no dashboard, ``_node_ip_address``), or joins
the cluster at ``address``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

APP_NAME = "opweave"
DEPLOYMENT = "OpweaveReplica"


@dataclass
class ReplicaOptions:
    """What one replica serves and how (``opweave serve``'s options; picklable, sent to every replica)."""

    models: list[str] = field(default_factory=list)
    model_files: dict[str, str] = field(default_factory=dict)
    model_repository: str | None = None
    device: str = "cpu"
    policy: str = "heuristic"
    policy_options: dict = field(default_factory=dict)
    max_queue: int = 64
    max_batch: int = 8
    max_sub_blocks: int = 4
    timeout_s: float | None = None
    scheduler: str = "lios"
    streams: int | None = None
    image_size: Any = None  # int or {"*": int, model: int}
    cuts: dict[str, list[str]] = field(default_factory=dict)
    compiler: str | None = "default"
    threads: int | None = 1  # torch intra-op threads per replica (its CPU share)
    pin_cores: bool = False  # each replica on its own `threads` cores, chosen by its local rank (see pin)
    max_body_bytes: int = 0  # raises every model's request limit (server.create_app)
    allow_symlinks_outside_root: bool = False  # the model repository's links (repository.Repository)
    strict: bool = False  # a model of the repository that does not load stops the replica


class Replica:
    """One engine and its app: what each Ray Serve replica holds (also usable alone, e.g. to test it)."""

    def __init__(self, options: ReplicaOptions):
        from pathlib import Path

        import torch

        from opweave.serve.build import load_models, make_engine
        from opweave.serve.frontend import State
        from opweave.serve.repository import Repository

        if options.threads:
            torch.set_num_threads(options.threads)
        o = options
        files = {k: Path(v) for k, v in o.model_files.items()}
        served = load_models(list(o.models), files, device=o.device, max_batch=o.max_batch,
                             image_size=o.image_size, cuts=o.cuts) if o.models or files or not o.model_repository \
            else {}
        self.engine = make_engine(served, device=o.device, policy=o.policy, policy_options=o.policy_options,
                                  max_queue=o.max_queue, max_batch=o.max_batch, max_sub_blocks=o.max_sub_blocks,
                                  timeout_s=o.timeout_s, scheduler=o.scheduler, streams=o.streams, compiler=o.compiler)
        self.repository = Repository(self.engine, served, o.model_repository, device=o.device,
                                     max_batch=o.max_batch, allow_symlinks_outside_root=o.allow_symlinks_outside_root)
        self.repository.load_all(strict=o.strict)
        # a load or unload through the proxy would reach one replica: the replicas' models change by redeploying
        self.repository.changes = ("on Ray Serve a repository load or unload would reach one replica only: change "
                                   "the models by deploying again (serve.run / opweave serve --ray)")
        self.state = State()
        self.options = options
        self.engine.start()

    def app(self):
        from opweave.serve.server import create_app

        return create_app(self.engine, self.repository.served, max_body_bytes=self.options.max_body_bytes,
                          state=self.state, repository=self.repository)

    def healthy(self) -> bool:
        thread = getattr(self.engine, "thread", None)
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        """Drain: requests accepted are answered, then the engine stops."""
        self.state.draining = True
        self.engine.stop(timeout_s=30)


def application(options: ReplicaOptions, *, replicas: int = 2, autoscaling: dict | None = None,
                num_cpus: float | None = None, num_gpus: float | None = None,
                max_ongoing_requests: int | None = None):
    """The Ray Serve application (bound, not yet run): ``replicas`` replicas of :class:`Replica` (or Ray's
    ``autoscaling`` config), each reserving ``num_cpus`` (default its intra-op threads) and ``num_gpus`` (default 1
    on ``cuda``). ``max_ongoing_requests`` per replica defaults to the engine's ``max_queue`` plus what its
    instances hold, so that Ray's proxy queues the rest rather than the engine refusing it."""
    from ray import serve

    @serve.deployment(name=DEPLOYMENT, health_check_period_s=2, health_check_timeout_s=30,
                      graceful_shutdown_timeout_s=30)
    @serve.ingress()
    class OpweaveReplica:
        def __init__(self, options: ReplicaOptions):
            if options.pin_cores:
                pin(serve.get_replica_context().rank.local_rank, options.threads or 1)
            self.replica = Replica(options)

        def __serve_build_asgi_app__(self):
            return self.replica.app()

        def check_health(self) -> None:
            if not self.replica.healthy():
                raise RuntimeError("the engine's thread has stopped")

        def __del__(self):
            replica = getattr(self, "replica", None)
            if replica is not None:
                replica.stop()

    settings: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": (options.threads or 1) if num_cpus is None else num_cpus,
                              "num_gpus": (1 if options.device == "cuda" else 0) if num_gpus is None else num_gpus},
        "max_ongoing_requests": max_ongoing_requests or options.max_queue + 4 * options.max_batch,
    }
    if autoscaling is not None:
        settings["autoscaling_config"] = autoscaling
    else:
        settings["num_replicas"] = replicas
    return OpweaveReplica.options(**settings).bind(options)


def pin(rank: int, count: int) -> list[int]:
    """Pin this process to ``count`` of the cores it may use, the ``rank``-th such group (wrapping around): Ray
    reserves CPUs only as numbers, and the CPU engine sizes its threads by the cores it may run on
    (:func:`opweave.backends.threads.cores`), so without pinning every replica of a node spreads over all its
    cores."""
    usable = sorted(os.sched_getaffinity(0))
    chosen = [usable[(rank * count + k) % len(usable)] for k in range(min(count, len(usable)))]
    os.sched_setaffinity(0, chosen)
    return chosen


def start_local(num_cpus: int | None = None, **init: Any) -> None:
    """A local Ray cluster on 127.0.0.1 (no dashboard), unless Ray is already initialized."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 log_to_driver=False, configure_logging=False, **init)


def deploy(options: ReplicaOptions, *, replicas: int = 2, autoscaling: dict | None = None,
           host: str = "127.0.0.1", port: int = 8000, address: str | None = None, num_cpus: float | None = None,
           num_gpus: float | None = None, cluster_cpus: int | None = None) -> str:
    """Deploy the engine on Ray Serve and return the proxy's URL once every replica is up. ``address``: an existing
    cluster (``ray://...`` or ``auto``); otherwise a local one on 127.0.0.1 (:func:`start_local`, ``cluster_cpus``
    CPUs). The proxy listens on ``host:port``."""
    import ray
    from ray import serve

    if address is not None:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    else:
        start_local(cluster_cpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(options, replicas=replicas, autoscaling=autoscaling, num_cpus=num_cpus,
                          num_gpus=num_gpus), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def replica_states() -> dict[str, int]:
    """How many replicas of the deployment are in each state (RUNNING, STARTING, ...)."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or DEPLOYMENT not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): v for k, v in app.deployments[DEPLOYMENT].replica_states.items()}


def shutdown() -> None:
    """Stop the deployment (replicas drain: Ray waits for their requests) and the local cluster."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


async def retrying_post(client, url: str, *, attempts: int = 5, backoff_s: float = 0.2, max_wait_s: float = 10.0,
                        **kwargs):
    """POST with the retry policy of the module docstring: a 5xx from Ray's proxy, or a connection error, is
    retried (up to ``attempts`` tries, ``backoff_s`` x try apart); a 429 (the replica's queue is full) is retried
    after its ``Retry-After`` seconds (at most ``max_wait_s``). Returns ``(response, failures)``, the failed tries
    before it (their status codes, or the transport errors' names). The server's other 4xx refusals (a bad
    request, an unknown model) are not retried: a second try would get the same answer."""
    import httpx

    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        wait = backoff_s * attempt
        try:
            response = await client.post(url, **kwargs)
        except httpx.TransportError as exc:
            if attempt == attempts:
                raise
            failures.append(type(exc).__name__)
        else:
            retry = response.status_code >= 500 or response.status_code == 429
            if not retry or attempt == attempts:
                return response, failures
            failures.append(str(response.status_code))
            if response.status_code == 429:
                try:
                    wait = min(max_wait_s, float(response.headers.get("Retry-After", wait)))
                except ValueError:  # an HTTP date instead of seconds: back off as for a 5xx
                    pass
        await asyncio.sleep(wait)
    raise AssertionError("unreachable")


__all__ = ["APP_NAME", "DEPLOYMENT", "Replica", "ReplicaOptions", "application", "deploy", "pin", "replica_states",
           "retrying_post", "shutdown", "start_local"]
