"""The serving engine as a Ray Serve deployment: N replicas, each one engine on its own device (a CPU share or a
GPU), behind Ray Serve's HTTP proxy with the same KServe v2 routes as ``opweave serve`` (the FastAPI app of
:func:`opweave.serve.http.app.create_app`, built inside each replica), reached through a front deployment that runs no
model (``OpweaveFront``, :func:`front_app`): Ray's proxy hands it each request, it hands the request to a replica
through a deployment handle (:meth:`Replica.forward`) and answers what the replica answered.

    from opweave.serve import ray as opweave_ray
    url = opweave_ray.deploy(ReplicaOptions(models=["squeezenet"], image_size=64), replicas=2)  # local cluster
    opweave serve --ray --replicas 2 --models squeezenet --image-size 64 --port 8000             # the same

Each replica builds its models and engine when Ray starts it (models from the zoo, ``.pt2`` files or a model
repository directory, which every node must see at the same path), and reports itself unhealthy if its engine's
thread stops, so that Ray replaces it. ``replicas`` fixes their number; ``autoscaling`` (Ray's
``autoscaling_config``: ``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...) lets Ray choose.

What a replica's death costs. The front hands each request to one replica. A request in flight on a replica that
dies fails in the front with Ray's actor error; inference is idempotent, so the front hands it to another replica
(up to :data:`FRONT_ATTEMPTS` tries, ``0.2 s`` x try apart, Ray's router picking a live one) and the client sees
only the answer. If no replica answers in that many tries, the front answers 503 in the protocol's error form
(``{"error": "..."}``), never Ray's plain-text 500 that a Triton client cannot parse (without the front, Ray's proxy
answered a dead replica's requests ``Internal Server Error`` in plain text). Ray starts a replacement. The survivors
take the dead replica's share, so their queues may fill: a 429 is a refusal, not a loss (the request was never
accepted), and it says when to come back (``Retry-After``); :func:`retrying_post` waits that long and tries again.
"No accepted request lost" means exactly that: every request the proxy accepted got a response, every one 200 with
eager's outputs (``tests/test_serve_ray.py`` kills a replica process mid-load and checks it with a plain client).
If the front itself died, Ray's proxy would answer its requests in flight with its plain-text 500 (the front runs no
model and holds nothing but requests in flight).

The front also checks what ``opweave serve`` checks of a request before any route
(:func:`opweave.serve.http.guard.guard`: the ``Host`` among ``allowed_hosts``, by default the proxy's bind address's
names; a web page's ``Origin`` among ``allow_origins``, with CORS for those; the content type; the header size), and
answers every refusal as ``{"error": ...}``; the replicas, which only the front reaches, do not check them again.

Ray runs on 127.0.0.1 when this module starts it (:func:`start_local`: no dashboard, ``_node_ip_address``), or joins
the cluster at ``address``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any, cast

APP_NAME = "opweave"
DEPLOYMENT = "OpweaveReplica"
FRONT = "OpweaveFront"
FRONT_ATTEMPTS = 5  # tries of a request whose replica died (module docstring)
HOP_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


@dataclass
class ReplicaOptions:
    """What one replica serves and how (``opweave serve``'s options; picklable, sent to every replica)."""

    models: list[str] = field(default_factory=list)
    model_files: dict[str, str] = field(default_factory=dict)
    model_repository: str | None = None
    device: str = "cpu"
    policy: str | None = None  # None: the device's default (serve.assemble.default_policy)
    policy_options: dict = field(default_factory=dict)
    max_queue: int = 64
    max_batch: int = 8
    max_sub_blocks: int = 4
    timeout_s: float | None = None
    options: Any = field(default_factory=dict)  # the resolved Options (replica_options), or a dict of them
    image_size: Any = None  # int or {"*": int, model: int}
    cuts: dict[str, list[str]] = field(default_factory=dict)
    pin_cores: bool = False  # each replica on its own `threads` cores, chosen by its local rank (see pin)
    max_body_bytes: int = 0  # raises every model's request limit (http.app.create_app)
    allow_symlinks_outside_root: bool = False  # the model repository's links (repository.Repository)
    strict: bool = False  # a model of the repository that does not load stops the replica
    allowed_hosts: tuple[str, ...] | None = None  # the front's Host names (None: the proxy's, http.guard.default_hosts)
    allow_origins: tuple[str, ...] = ()  # web pages' origins the front lets in, with CORS (http.guard.guard)

    def resolved(self):
        """The options every combined block of a replica is built with: ``options`` when they are resolved already
        (:func:`replica_options`, as ``opweave serve --ray`` and :func:`deploy` hand them to the replicas), else
        resolved from the dict, checked before any model loads."""
        from opweave.pipeline import Options

        if isinstance(self.options, Options):
            return self.options
        return replica_options(self.device, self.options)

    @property
    def threads(self) -> int:
        """The CPU threads one replica uses (what Ray reserves for it, and the cores it is pinned to)."""
        return self.resolved().threads or 1


def replica_options(device: str, options: dict | None = None, *, mode: str | None = None):
    """The resolved options of one replica (:func:`opweave.serve.assemble.serving_options`, the serving preset): on
    a CPU its lanes use ``threads`` in all, by default 1 (its share of the machine: what Ray reserves for it)."""
    from opweave.serve.assemble import serving_options

    options = options or {}
    share = {"threads": 1} if device == "cpu" and options.get("threads") is None else {}
    return serving_options(device, {**options, **share}, mode=mode)


class Replica:
    """One engine and its app: what each Ray Serve replica holds (also usable alone, e.g. to test it)."""

    def __init__(self, options: ReplicaOptions):
        from pathlib import Path

        from opweave.serve.assemble import load_models, make_engine
        from opweave.serve.frontend import State
        from opweave.serve.repository.repository import Repository

        o = options
        settings = o.resolved()  # checked before any model loads
        files = {k: Path(v) for k, v in o.model_files.items()}
        served = load_models(list(o.models), files, device=o.device, max_batch=o.max_batch,
                             image_size=o.image_size, cuts=o.cuts) if o.models or files or not o.model_repository \
            else {}
        self.engine = make_engine(served, device=o.device, options=settings, policy=o.policy,
                                  policy_options=o.policy_options, max_queue=o.max_queue, max_batch=o.max_batch,
                                  max_sub_blocks=o.max_sub_blocks, timeout_s=o.timeout_s)
        self.repository = Repository(self.engine, served, o.model_repository, device=o.device,
                                     max_batch=o.max_batch, allow_symlinks_outside_root=o.allow_symlinks_outside_root)
        self.repository.load_all(strict=o.strict)
        # a load or unload through the proxy would reach one replica: the replicas' models change by redeploying
        self.repository.changes = ("on Ray Serve a repository load or unload would reach one replica only: change "
                                   "the models by deploying again (serve.run / opweave serve --ray)")
        self.state = State()
        self.options = options
        self._app: Any = None
        self._client: Any = None
        self.engine.start()

    def app(self):
        """The replica's FastAPI app (:func:`opweave.serve.http.app.create_app`), built once."""
        from opweave.serve.http.app import create_app

        if self._app is None:
            self._app = create_app(self.engine, self.repository.served, max_body_bytes=self.options.max_body_bytes,
                                   state=self.state, repository=self.repository, guarded=False)  # the front checks
        return self._app

    async def forward(self, method: str, raw_path: bytes, query: bytes, headers: list, body: bytes
                      ) -> tuple[int, list, bytes]:
        """One HTTP request, as the front received it, through the app: its status, headers and body."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app()), base_url="http://replica",
                                             timeout=None)
        url = httpx.URL("http://replica", raw_path=raw_path + (b"?" + query if query else b""))
        response = await self._client.request(method, url, content=body,
                                              headers=[(k, v) for k, v in headers if k.lower() not in HOP_HEADERS])
        return response.status_code, [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_HEADERS], \
            response.content

    def body_limit(self) -> int:
        """The most bytes a request's body may take here: the largest of the served models' request limits
        (:func:`opweave.serve.protocol.request_limit`, raised to ``max_body_bytes``), as the app enforces them."""
        from opweave.serve.protocol import HEADER_BYTES, request_limit

        floor = self.options.max_body_bytes
        return max((request_limit(m, floor=floor) for m in self.repository.served.values()),
                   default=max(floor, HEADER_BYTES))

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
    from dataclasses import replace

    from ray import serve

    options = replace(options, options=options.resolved())  # checked here, before Ray starts a replica: resolved once
    threads = options.threads

    @serve.deployment(name=DEPLOYMENT, health_check_period_s=2, health_check_timeout_s=30,
                      graceful_shutdown_timeout_s=30)
    class OpweaveReplica:
        def __init__(self, options: ReplicaOptions):
            if options.pin_cores:
                pin(serve.get_replica_context().rank.local_rank, options.threads)
            self.replica = Replica(options)
            self.replica.app()

        async def forward(self, request: tuple) -> tuple[int, list, bytes]:
            return await self.replica.forward(*request)

        async def body_limit(self) -> int:
            return self.replica.body_limit()

        def check_health(self) -> None:
            if not self.replica.healthy():
                raise RuntimeError("the engine's thread has stopped")

        def __del__(self):
            replica = getattr(self, "replica", None)
            if replica is not None:
                replica.stop()

    @serve.deployment(name=FRONT, graceful_shutdown_timeout_s=30)
    @serve.ingress()
    class OpweaveFront:
        def __init__(self, replicas, allowed_hosts: tuple[str, ...], allow_origins: tuple[str, ...]):
            self.replicas, self.allowed_hosts, self.allow_origins = replicas, allowed_hosts, allow_origins

        def __serve_build_asgi_app__(self):
            from opweave.serve.http.guard import guard

            return guard(front_app(lambda request: self.replicas.forward.remote(request),
                                   lambda: self.replicas.body_limit.remote()), self.allowed_hosts, self.allow_origins)

    per_replica = max_ongoing_requests or options.max_queue + 4 * options.max_batch
    settings: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": threads if num_cpus is None else num_cpus,
                              "num_gpus": (1 if options.device == "cuda" else 0) if num_gpus is None else num_gpus},
        "max_ongoing_requests": per_replica,
    }
    if autoscaling is not None:
        settings["autoscaling_config"] = autoscaling
    else:
        settings["num_replicas"] = replicas
    most = (autoscaling or {}).get("max_replicas", replicas)
    replica: Any = OpweaveReplica  # serve.deployment made both Deployments
    front = cast(Any, OpweaveFront).options(num_replicas=1, ray_actor_options={"num_cpus": 0},
                                            max_ongoing_requests=per_replica * most)
    from opweave.serve.http.guard import LOOPBACK_HOSTS

    return front.bind(replica.options(**settings).bind(options), options.allowed_hosts or LOOPBACK_HOSTS,
                      tuple(options.allow_origins))


def front_app(forward, limit, attempts: int = FRONT_ATTEMPTS, backoff_s: float = 0.2):
    """The front's ASGI app (module docstring): each HTTP request (its body at most ``limit`` bytes: an int, or an
    awaitable function asked once, at the first request, for the replicas' :meth:`Replica.body_limit`, so that a body
    no model accepts is refused before it is read whole or shipped to a replica) handed as ``(method, raw_path,
    query, headers, body)`` to ``forward`` (awaitable: a replica's answer ``(status, headers, body)``); a request
    whose replica died (Ray's ``RayActorError``) is handed on again, up to ``attempts`` tries ``backoff_s`` x try
    apart. Every error it answers itself is the protocol's ``{"error": one line}``."""
    import json

    from ray.exceptions import RayActorError

    from opweave.errors import first_line
    from opweave.serve.frontend import one_line

    def error(status: int, message: str) -> tuple[int, list, bytes]:
        return status, [(b"content-type", b"application/json")], json.dumps({"error": one_line(message)}).encode()

    known = [limit] if isinstance(limit, int) else []

    class Unanswered(Exception):
        pass

    async def handed(call, *args):
        """``call(*args)`` on a replica, again while the replica it reached died (Ray picks a live one)."""
        for attempt in range(1, attempts + 1):
            try:
                return await call(*args)
            except RayActorError as exc:  # the replica died (or cannot be reached): another one takes the request
                if attempt == attempts:
                    raise Unanswered(f"no replica answered in {attempts} tries (the last: {first_line(exc)})") \
                        from None
            await asyncio.sleep(backoff_s * attempt)
        raise AssertionError("unreachable")

    async def answer(scope, receive) -> tuple[int, list, bytes]:
        try:
            if not known:
                known.append(int(await handed(limit)))
            most = known[0]
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > most:
                return error(400, f"request body of {int(declared)} bytes exceeds the limit of {most} bytes")
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return error(400, "the client went away")
                body += message.get("body", b"")
                if len(body) > most:
                    return error(400, f"request body exceeds the limit of {most} bytes")
                if not message.get("more_body"):
                    break
            return await handed(forward, (scope["method"], scope.get("raw_path") or scope["path"].encode(),
                                          scope["query_string"], scope["headers"], bytes(body)))
        except Unanswered as exc:
            return error(503, str(exc))
        except Exception as exc:  # noqa: BLE001 - answered in the protocol's form, never as Ray's plain text
            return error(500, first_line(exc))

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        status, headers, content = await answer(scope, receive)
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})

    return app


def pin(rank: int, count: int) -> list[int]:
    """Pin this process to ``count`` of the cores it may use, the ``rank``-th such group (wrapping around): Ray
    reserves CPUs only as numbers, and the CPU engine sizes its threads by the cores it may run on
    (:func:`opweave.backends.threads.cores`), so without pinning every replica of a node spreads over all its
    cores."""
    usable = sorted(os.sched_getaffinity(0))
    chosen = [usable[(rank * count + k) % len(usable)] for k in range(min(count, len(usable)))]
    os.sched_setaffinity(0, chosen)
    return chosen


# Ray Serve's controller kills a proxy that is not ready within 5 s of its start (10 s per health check): on a busy
# machine its HTTP proxy was killed before it ever ran, and the deployment failed. A local cluster gives it a minute.
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                 "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def start_local(num_cpus: int | None = None, **init: Any) -> None:
    """A local Ray cluster on 127.0.0.1 (no dashboard), unless Ray is already initialized; its processes inherit
    :data:`LOCAL_RAY_ENV` where the environment does not set them."""
    import ray

    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 log_to_driver=False, configure_logging=False, **init)


def deploy(options: ReplicaOptions, *, replicas: int = 2, autoscaling: dict | None = None,
           host: str = "127.0.0.1", port: int = 8000, address: str | None = None, num_cpus: float | None = None,
           num_gpus: float | None = None, cluster_cpus: int | None = None) -> str:
    """Deploy the engine on Ray Serve and return the proxy's URL once every replica is up. ``address``: an existing
    cluster (``ray://...`` or ``auto``); otherwise a local one on 127.0.0.1 (:func:`start_local`, ``cluster_cpus``
    CPUs). The proxy listens on ``host:port``."""
    from dataclasses import replace

    options = replace(options, options=options.resolved())  # refused here, before Ray starts; replicas get them
    import ray
    from ray import serve

    if address is not None:
        if not ray.is_initialized():
            from ray.exceptions import AuthenticationError

            from opweave.errors import UsageError, first_line

            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, AuthenticationError) as exc:
                raise UsageError(f"--ray-address {address}: cannot join the Ray cluster ({first_line(exc)}); a "
                                 f"cluster with token authentication needs its token here too: RAY_AUTH_MODE=token "
                                 f"and RAY_AUTH_TOKEN or ~/.ray/auth_token (docs/serving.md, Ray Serve)") from None
    else:
        start_local(cluster_cpus)
    if options.allowed_hosts is None:
        from opweave.serve.http.guard import default_hosts

        options = replace(options, allowed_hosts=default_hosts(host))
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


__all__ = ["APP_NAME", "DEPLOYMENT", "FRONT", "FRONT_ATTEMPTS", "Replica", "ReplicaOptions", "application", "deploy",
           "front_app", "pin", "replica_options", "replica_states", "retrying_post", "shutdown", "start_local"]
