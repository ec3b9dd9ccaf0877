"""Serving commands: ``serve`` (the Open Inference Protocol server), ``export`` (a model written as an entry of a
model repository), ``loadgen`` (TOP's arrival patterns, over HTTP or simulated) and ``blocks`` (a model's blocks
beside TOP Table II)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from opweave.cli.app import DeviceOpt, JsonOpt, ModeOpt, OptionOpt, app, collect_options, err, guard, out
from opweave.devices import NAMES
from opweave.errors import DeviceError, UsageError, did_you_mean

# The default policies (opweave.serve.assemble.DEFAULT_POLICIES), said the same way in both commands' help.
SimPolicyOpt = Annotated[str | None, typer.Option("--policy", help="with --simulate: static | batch | heuristic | top; "
                                                  "default: heuristic, the default on a GPU, which the simulator "
                                                  "models (with --url the server runs its own)")]
ServePolicyOpt = Annotated[str | None, typer.Option("--policy", help="static | batch | heuristic | top; default: "
                                                    "static on a CPU, heuristic on a GPU (docs/serving.md)")]
ON_DEVICE = {"cpu": "a CPU", "cuda": "a GPU", "sim": "the simulator"}  # where a default policy applies, in words
PolicyOptionsOpt = Annotated[str | None, typer.Option("--policy-options", metavar="KEY=VALUE,...",
                                                      help="the policy's options (e.g. drain_s=0.5 for heuristic)")]
PolicyFileOpt = Annotated[Path | None, typer.Option("--policy-file", help="trained policy (top: opweave "
                                                    "train-policy; default: the one shipped for the models)")]
MaxQueueOpt = Annotated[int, typer.Option("--max-queue", min=1, help="requests waiting per model (then 429)")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batch", min=1, help="samples stacked in one instance")]
HOpt = Annotated[int, typer.Option("--max-sub-blocks", min=1, help="H: sub-blocks per combined block")]
SchedulerOpt = Annotated[str | None, typer.Option("--scheduler", "-s", help="schedules each combined block (default: "
                                                  "lios; heft over blocks compiled whole)")]
StreamsOpt = Annotated[int | None, typer.Option("--streams", min=1, help="streams per combined block")]
ImageSizeOpt = Annotated[str | None, typer.Option("--image-size", metavar="N[,MODEL=N...]",
                                                  help="input size of zoo CNNs: N for all, MODEL=N for one")]
CutsOpt = Annotated[list[str] | None, typer.Option("--cuts", metavar="MODEL=OP+OP...",
                                                   help="cut the model's blocks exactly after these ops; repeat for "
                                                        "more models")]


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _policy_options(policy: str, text: str | None, policy_file: Path | None) -> dict:
    """``--policy-options`` as a dict, with ``--policy-file`` as its ``policy_file``; the policy's name and
    options checked, before any model loads."""
    from opweave.serve.engine import policies

    policies.check(policy)
    options = policies.parse_options(text)
    if policy_file is not None:
        if not policy_file.is_file():
            raise UsageError(f"--policy-file {policy_file}: no such file")
        options["policy_file"] = str(policy_file)
    policies.check(policy, options)
    return options


@app.command()
@guard
def serve(models: Annotated[str | None, typer.Option("--models", metavar="MODEL,...", help="zoo models")] = None,
          model_file: Annotated[list[str] | None, typer.Option(
              "--model-file", metavar="[NAME=]PATH.pt2", help="a model saved by torch.export.save (.pt2), served "
                                                                "under its file name (NAME=PATH.pt2: under NAME); "
                                                                "repeat for more")] = None,
          device: DeviceOpt = "auto",
          host: Annotated[str, typer.Option("--host", help="address to listen on (0.0.0.0: every interface)")
                          ] = "127.0.0.1",
          port: Annotated[int, typer.Option("--port", min=0, max=65535, help="0: any free port")] = 8000,
          grpc_port: Annotated[int | None, typer.Option("--grpc-port", min=0, max=65535,
                                                        help="serve KServe v2 gRPC here too (0: any free port)")
                               ] = None,
          model_repository: Annotated[Path | None, typer.Option(
              "--model-repository", help="DIR/NAME/VERSION/model.pt2 (+ DIR/NAME/config.pbtxt): every model "
              "loaded at start (one that does not load is UNAVAILABLE, the others served). Trusted: a .pt2 is "
              "code; nothing outside DIR is loaded")] = None,
          model_control_mode: Annotated[str, typer.Option(
              "--model-control-mode", help="none: the repository API neither loads nor unloads (Triton's "
              "default); explicit: clients may load and unload models of --model-repository")] = "none",
          allow_symlinks_outside_root: Annotated[bool, typer.Option(
              "--allow-symlinks-outside-root", help="follow symbolic links in --model-repository that lead "
              "outside it (refused by default)")] = False,
          strict: Annotated[bool, typer.Option("--strict", help="exit if a model of --model-repository does not "
                                               "load at start (Triton's --exit-on-error)")] = False,
          ray: Annotated[bool, typer.Option("--ray", help="deploy on Ray Serve: --replicas engines behind its HTTP "
                                                          "proxy (needs opweave\\[ray])")] = False,
          replicas: Annotated[int, typer.Option("--replicas", min=1, help="Ray Serve replicas (with --ray)")] = 2,
          max_replicas: Annotated[int | None, typer.Option("--max-replicas", min=1, help="with --ray: let Ray "
                                                           "autoscale from --replicas up to this many")] = None,
          ray_address: Annotated[str | None, typer.Option("--ray-address", help="with --ray: join this cluster "
                                                          "(default: a local one on 127.0.0.1)")] = None,
          pin_cores: Annotated[bool, typer.Option("--pin-cores", help="with --ray: each replica on its own "
                                                  "--threads cores (else each engine spreads over all)")] = False,
          policy: ServePolicyOpt = None, policy_options: PolicyOptionsOpt = None,
          policy_file: PolicyFileOpt = None, max_queue: MaxQueueOpt = 64, max_batch: MaxBatchOpt = 8,
          max_sub_blocks: HOpt = 4,
          timeout_ms: Annotated[float | None, typer.Option("--timeout-ms", help="default request deadline")] = None,
          scheduler: SchedulerOpt = None, streams: StreamsOpt = None, image_size: ImageSizeOpt = None,
          cuts: CutsOpt = None,
          max_body_mb: Annotated[float | None, typer.Option(
              "--max-body-mb", min=0, help="raise every model's request size limit to this many MiB (default: "
              "each model's own, from its inputs at its max batch; larger requests get 400 / INVALID_ARGUMENT)")
                                 ] = None,
          header_timeout_s: Annotated[float, typer.Option(
              "--header-timeout-s", min=0.1, help="a request's headers (gRPC: the HTTP/2 handshake) must arrive "
              "within this")] = 10.0,
          idle_timeout_s: Annotated[float, typer.Option(
              "--idle-timeout-s", min=0.1, help="close a connection idle this long (HTTP: kept alive, or a body "
              "or an answer slower than --min-body-rate-kib over this long; gRPC: no call, or a call's message not "
              "there this long after the call)")] = 60.0,
          min_body_rate_kib: Annotated[float, typer.Option(
              "--min-body-rate-kib", min=0, help="HTTP: KiB a second a body must bring, and an answer be read at, "
              "over every --idle-timeout-s (a trickle does not keep a connection)")] = 16.0,
          max_held_mb: Annotated[float, typer.Option(
              "--max-held-mb", min=1, help="MiB that unfinished request bodies, unread answers and gRPC messages "
              "may hold in all; a new body past it gets 503 with Retry-After (gRPC: UNAVAILABLE)")] = 512.0,
          max_connections: Annotated[int | None, typer.Option(
              "--max-connections", min=1, help="connections each front end holds at once (HTTP: the one idle "
              "longest is closed to make room, else a new one gets 503; gRPC: a new one is closed). Default: 4096, "
              "or fewer as the open-file limit (ulimit -n) allows")] = None,
          max_grpc_calls: Annotated[int, typer.Option(
              "--max-grpc-calls", min=1, help="gRPC calls in progress at once; more get RESOURCE_EXHAUSTED")] = 1024,
          max_grpc_metadata_kib: Annotated[float, typer.Option(
              "--max-grpc-metadata-kib", min=1, help="a gRPC call's metadata (its headers); more gets "
              "RESOURCE_EXHAUSTED")] = 16.0,
          allowed_hosts: Annotated[str | None, typer.Option(
              "--allowed-hosts", help="comma list of the Host names clients reach the server by (a proxy's public "
              "name; *.example.com a domain's; * any); others are refused (DNS rebinding). Default: localhost, "
              "127.0.0.1 and [::1] on a loopback --host, the --host itself otherwise, any on 0.0.0.0")] = None,
          cors_allow_origin: Annotated[list[str] | None, typer.Option(
              "--cors-allow-origin", help="a web page's origin (https://app.example.com) that may call the server "
              "(CORS); repeat for more. Default: none: a request from a web page is refused")] = None,
          threads: Annotated[int | None, typer.Option("--threads", min=1, help="cpu: the threads each combined "
                                                      "block's lanes may use in all, as opweave.compile's threads "
                                                      "(default: every core; with --ray, 1 per replica)")] = None,
          compiler: Annotated[str | None, typer.Option("--compiler", help="cpu: each block compiled whole by "
                                                                  "onnxruntime or inductor, or none (TOP's combined op "
                                                                  "graphs); default onnxruntime when installed")
                              ] = None,
          mode: ModeOpt = None, options: OptionOpt = None,
          log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level: critical, error, "
                                                 "warning, info, debug or trace")] = "warning"):
    """Serve models over the Open Inference Protocol (KServe v2 / Triton HTTP, and gRPC with ``--grpc-port``) until
    SIGTERM, which drains. ``--model-repository`` serves Triton's repository layout (docs/serving.md). ``--ray``
    runs ``--replicas`` engines as a Ray Serve deployment instead (opweave.serve.ray).

    What the server trusts: the repository's contents and these flags; never a client (docs/serving.md,
    "Security"). Model names are plain names, nothing outside the repository is loaded, requests larger than a
    model's inputs need are refused before they are read, and the repository API is read-only unless
    ``--model-control-mode explicit``. A web page may not call the server (``--cors-allow-origin`` lets one), nor
    reach it under a name not in ``--allowed-hosts``.

    On the CPU a combined block runs on one lane per core and each of its ops (or blocks, with ``--compiler``) on the
    cores its lane may use while it runs (opweave.backends.threads), so lanes x intra-op threads never exceed the
    cores. With ``--compiler`` (the default when ONNX Runtime is installed) every block is compiled before the server
    listens: ONNX Runtime's one session for any batch (other compilers: the batch-1 variant and the batch sizes of a
    config's model_warmup; other batches when first asked for, in the background).

    Defaults that follow the device, printed when the server listens: ``--policy`` static on a CPU (it sustained the
    highest rates measured there: ONNX Runtime's threads already fill the cores, and pipelining only lengthens each
    request), heuristic on a GPU; ``--compiler`` onnxruntime on a CPU where it is installed (the serving preset,
    the options table's last column). ``--mode`` and ``--option`` are resolved as ``opweave.compile`` resolves them,
    with that preset: what a server cannot honour is refused with the reason."""
    from opweave.serve.assemble import (
        check_models,
        default_policy,
        load_models,
        make_engine,
        parse_cuts,
        parse_image_size,
        serving_options,
    )
    from opweave.serve.models import parse_model_files
    from opweave.serve.repository.repository import CONTROL_MODES, Repository
    from opweave.serve.server import serve as run_server

    if device == "auto":
        from opweave.devices import resolve_device

        device = resolve_device(device)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or auto, got {device!r}{did_you_mean(device, NAMES)}")
    mode, given = collect_options(options, mode, scheduler=scheduler, streams=streams, compiler=compiler,
                                  threads=threads)
    if ray:  # every option checked, before any model loads
        from opweave.serve.ray import replica_options

        settings = replica_options(device, given, mode=mode)
    else:
        settings = serving_options(device, given, mode=mode)
    if device == "cuda" and not (ray and ray_address is not None):  # a remote cluster's replicas hold the GPUs
        import torch

        if not torch.cuda.is_available():  # one line, before any model loads (it loaded them and then failed)
            raise DeviceError("CUDA is not available on this machine; use --device cpu")
    if model_control_mode not in CONTROL_MODES:
        raise UsageError(f"--model-control-mode must be one of {', '.join(CONTROL_MODES)}, got "
                         f"{model_control_mode!r}{did_you_mean(model_control_mode, CONTROL_MODES)}")
    max_body_bytes = 0 if max_body_mb is None else int(max_body_mb * (1 << 20))
    if max_body_mb is not None and max_body_mb > max_held_mb:
        raise UsageError(f"--max-body-mb {max_body_mb:g} is more than --max-held-mb {max_held_mb:g}: a body that size "
                         "could never be admitted (raise --max-held-mb)")
    if not ray:  # before any model loads: the connections must fit the open-file limit
        from opweave.serve.frontend import connection_limit

        connection_limit(max_connections, 1 if grpc_port is None else 2)
    hosts = None if allowed_hosts is None else tuple(h.strip().lower() for h in allowed_hosts.split(",") if h.strip())
    if hosts == ():
        raise UsageError("--allowed-hosts names no host (give * to answer any)")
    origins = tuple(_origins(cors_allow_origin))
    chosen = "" if policy else f" (the default on {ON_DEVICE.get(device, device)})"
    policy = policy or default_policy(device)
    policy_settings = _policy_options(policy, policy_options, policy_file)
    files = parse_model_files(model_file)
    if ray:
        if grpc_port is not None:
            raise UsageError("--grpc-port does not go with --ray: Ray Serve's proxy speaks HTTP here")
        if model_control_mode != "none":
            raise UsageError("--model-control-mode explicit does not go with --ray: a load through the proxy would "
                             "reach one replica")
        from opweave.serve.ray import ReplicaOptions

        _serve_ray(ReplicaOptions(
            models=_names(models), model_files={k: str(v.resolve()) for k, v in files.items()},
            model_repository=None if model_repository is None else str(model_repository.resolve()), device=device,
            policy=policy, policy_options=policy_settings, max_queue=max_queue, max_batch=max_batch,
            max_sub_blocks=max_sub_blocks, timeout_s=None if timeout_ms is None else timeout_ms / 1e3,
            options=settings,
            image_size=parse_image_size(image_size), cuts=parse_cuts(cuts),
            max_body_bytes=max_body_bytes,
            allowed_hosts=hosts, allow_origins=origins,
            pin_cores=pin_cores, allow_symlinks_outside_root=allow_symlinks_outside_root, strict=strict),
            replicas, max_replicas, host, port, ray_address, chosen)
        return
    if model_repository is not None and not model_repository.is_dir():
        raise UsageError(f"--model-repository {model_repository}: no such directory")
    if model_repository is None or models or files:
        check_models(_names(models), files)  # before the progress line
    with _loading() as say:
        served = load_models(_names(models), files, device=device, max_batch=max_batch,
                             image_size=parse_image_size(image_size), cuts=parse_cuts(cuts), say=say) \
            if model_repository is None or models or files else {}
        engine = make_engine(served, device=device, options=settings, policy=policy, policy_options=policy_settings,
                             max_queue=max_queue, max_batch=max_batch, max_sub_blocks=max_sub_blocks,
                             timeout_s=None if timeout_ms is None else timeout_ms / 1e3, say=say)
        repository = Repository(engine, served, model_repository, device=device, max_batch=max_batch,
                                control=model_control_mode, allow_symlinks_outside_root=allow_symlinks_outside_root)
        repository.load_all(strict=strict, say=say)
    blocks = ", ".join(f"{n} ({len(m.blocked.blocks)} blocks)" for n, m in served.items()) or "no model"

    unavailable = [m["name"] for m in repository.index() if m["state"] != "READY"]
    down = f"; UNAVAILABLE: {', '.join(unavailable)} (see the repository index)" if unavailable else ""

    chose = " (the default)" if "compiler" not in given else ""
    builds = "" if device != "cpu" else (f"; compiler {settings.compiler or 'none'}{chose}, {settings.threads} "
                                          "threads")

    def listening(h: str, p: int, g: int | None = None) -> None:
        rpc = f"gRPC on {h}:{g}; " if g is not None else ""
        print(f"opweave serve: {blocks}{down}; device {device}, policy {policy}{chosen}{builds}; {rpc}listening on "
              f"http://{h}:{p}", flush=True)

    run_server(engine, served, host=host, port=port, max_body_bytes=max_body_bytes, log_level=log_level,
               on_listen=listening, grpc_port=grpc_port, repository=repository, header_timeout_s=header_timeout_s,
               idle_timeout_s=idle_timeout_s, allowed_hosts=hosts, allow_origins=origins,
               max_held_bytes=int(max_held_mb * (1 << 20)), min_body_rate=min_body_rate_kib * 1024,
               max_connections=max_connections,
               grpc_options={"max_calls": max_grpc_calls, "max_metadata_bytes": int(max_grpc_metadata_kib * 1024)})


@contextlib.contextmanager
def _loading():
    """What the server does before it listens (models captured, split and compiled: seconds to minutes), one line
    at a time on stderr with the time so far, each step also printed as it starts where stderr is not a terminal
    (a log); yields the function that says the next step."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("opweave serve: starting", total=None)

        def say(text: str) -> None:
            bar.update(task, description=f"opweave serve: {text}")
            if not err.is_terminal:
                err.print(f"opweave serve: {text}", highlight=False)

        yield say


def _origins(items: list[str] | None) -> list[str]:
    """``--cors-allow-origin`` values (each may be a comma list) as origins: ``scheme://host[:port]``, or ``*``."""
    from urllib.parse import urlsplit

    out = []
    for item in items or []:
        for origin in filter(None, (o.strip().rstrip("/") for o in item.split(","))):
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path or
                                  parts.query or parts.fragment):
                raise UsageError(f"--cors-allow-origin {origin!r} is no origin: give scheme://host[:port], as a "
                                 f"browser sends it (https://app.example.com)")
            out.append(origin)
    return out


def _serve_ray(options, replicas: int, max_replicas: int | None, host: str, port: int,
               address: str | None, chosen: str = "") -> None:
    """``opweave serve --ray``: deploy, print where, wait for SIGTERM or SIGINT, then shut Ray Serve down (its
    replicas drain: Ray waits for the requests they hold)."""
    import signal
    import socket
    import threading

    from opweave.cores import cores
    from opweave.serve import ray as opweave_ray

    if options.model_repository is None and not options.models and not options.model_files:
        raise UsageError("no model to serve; give --models, --model-file and/or --model-repository")
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    autoscaling = None if max_replicas is None else {
        "min_replicas": replicas, "max_replicas": max(max_replicas, replicas),
        "target_ongoing_requests": 2 * options.max_batch}
    stop = threading.Event()
    cpus = max(cores(), (max_replicas or replicas) * (options.threads or 1))
    try:
        url = opweave_ray.deploy(options, replicas=replicas, autoscaling=autoscaling, host=host, port=port,
                                 address=address, cluster_cpus=cpus)
        for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose own SIGTERM handler aborts the process
            signal.signal(sig, lambda *_: stop.set())
        print(f"opweave serve: Ray Serve, {replicas} replicas"
              f"{f' (autoscaling to {max_replicas})' if max_replicas else ''}; policy {options.policy}{chosen}; "
              f"listening on {url}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        opweave_ray.shutdown()


@app.command()
@guard
def export(model: Annotated[str, typer.Argument(help="zoo name, timm:NAME or hf:NAME (random weights, nothing "
                                                     "downloaded); with --module, the entry's name")],
           repository: Annotated[Path, typer.Argument(help="the model repository to write into (created if missing)")],
           module: Annotated[str | None, typer.Option("--module", help="MODULE:FUNCTION: your own model, a "
                                                      "function returning (model, example_inputs)")] = None,
           name: Annotated[str | None, typer.Option("--name", help="the entry's name (default: MODEL without its "
                                                    "prefix)")] = None,
           version: Annotated[int, typer.Option("--version", min=1, help="the version directory")] = 1,
           max_batch: Annotated[int, typer.Option("--max-batch", min=1, max=1024, help="max_batch_size of the "
                                                  "config, where requests can stack")] = 8,
           image_size: Annotated[int | None, typer.Option("--image-size", min=1, help="input size of a zoo "
                                                          "CNN")] = None,
           free_dim: Annotated[list[str] | None, typer.Option(
               "--free-dim", metavar="INPUT:DIM=MIN-MAX", help="a dimension whose size may vary between requests (a "
               "sequence length), served at any size in MIN..MAX; INPUT:DIM,INPUT:DIM=MIN-MAX for dimensions that are "
               "always equal; repeat for more")] = None,
           force: Annotated[bool, typer.Option("--force", help="replace an entry that exists")] = False):
    """Write MODEL as an entry of a model repository: REPOSITORY/NAME/VERSION/model.pt2 (torch.export) and
    REPOSITORY/NAME/config.pbtxt (its inputs' and outputs' names, datatypes and shapes, and max_batch_size, as
    opweave serve will serve them). Then: opweave serve --model-repository REPOSITORY."""
    from opweave.serve.repository import export as exporting

    if module is not None:
        made, inputs = exporting.from_factory(module)
        entry = name or model
    else:
        made, inputs = exporting.from_zoo(model, image_size)
        entry = name or exporting.entry_name(model)
    free = exporting.parse_free_dims(free_dim)
    served = exporting.export(made, inputs, repository, entry, version=version, max_batch=max_batch, force=force,
                              free=free)
    shapes = ", ".join(f"{s.name} {s.datatype} {list(s.shape)}" for s in served.inputs)
    err.print(f"wrote {repository / entry / str(version) / 'model.pt2'} and {repository / entry / 'config.pbtxt'} "
              f"(inputs {shapes}; {len(served.blocked.blocks)} blocks); serve it: opweave serve --model-repository "
              f"{repository}", markup=False, highlight=False, soft_wrap=True)


@app.command()
@guard
def loadgen(pattern: Annotated[str, typer.Option("--pattern", metavar="MODEL:RATE,...", help="each model's "
                                                           "requests per second")],
            url: Annotated[str | None, typer.Option("--url", help="server to load (http://host:port)")] = None,
            arrivals: Annotated[str, typer.Option("--arrivals", help="poisson | constant")] = "poisson",
            duration: Annotated[float, typer.Option("--duration", min=0.01, help="seconds of arrivals")] = 10.0,
            scale: Annotated[float, typer.Option("--scale", min=0.0001, help="multiply every rate")] = 1.0,
            seed: Annotated[int, typer.Option("--seed", help="random seed of the arrivals")] = 0,
            simulate: Annotated[bool, typer.Option("--simulate", help="run the engine in simulation, no HTTP")] = False,
            device_preset: Annotated[str, typer.Option("--preset", "--device-preset",
                                                       help="roofline preset (simulation)")] = "h100",
            policy: SimPolicyOpt = None, policy_options: PolicyOptionsOpt = None,
            policy_file: PolicyFileOpt = None, max_queue: MaxQueueOpt = 64,
            max_batch: MaxBatchOpt = 8, max_sub_blocks: HOpt = 4, scheduler: SchedulerOpt = None,
            streams: StreamsOpt = None, image_size: ImageSizeOpt = None,
            profile: Annotated[list[str] | None, typer.Option(
                "--profile", metavar="MODEL=PATH", help="measured profile (opweave profile) for simulation; repeat "
                                                        "for more models")] = None,
            output: Annotated[Path | None, typer.Option("--output", "-o", help="write the JSON report here")] = None,
            plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG here")] = None,
            as_json: JsonOpt = False):
    """Send TOP-style arrival patterns to a server (or simulate them): throughput, p50/p99 per model, rejections,
    errors, queue-length variance over time.

    With ``--url`` the server runs the policy it was started with (``opweave serve``: static on a CPU, heuristic on
    a GPU); with ``--simulate`` the engine runs ``--policy``, by default heuristic, the default on a GPU, which the
    simulator models."""
    from opweave.serve import loadgen as lg

    rates = lg.parse_pattern(pattern)
    if simulate == (url is not None):
        raise UsageError("give --url URL to load a server, or --simulate to run the engine in simulation")
    if profile and not simulate:
        raise UsageError("--profile goes with --simulate")
    if not simulate and (policy, policy_options, policy_file) != (None, None, None):
        raise UsageError("--policy, --policy-options and --policy-file go with --simulate (a server runs the policy "
                         "it was started with)")
    if simulate:
        from opweave.serve.assemble import (
            default_policy,
            load_models,
            load_profiles,
            make_engine,
            parse_image_size,
            serving_options,
        )

        mode, given = collect_options(None, scheduler=scheduler, streams=streams)
        settings = serving_options("sim", given, mode=mode)  # before any model loads
        policy = policy or default_policy("sim")
        options = _policy_options(policy, policy_options, policy_file)
        served = load_models(list(rates), device="sim", max_batch=max_batch,
                             image_size=parse_image_size(image_size))
        engine = make_engine(served, device="sim", options=settings, policy=policy, policy_options=options,
                             max_queue=max_queue, max_batch=max_batch, max_sub_blocks=max_sub_blocks,
                             preset=device_preset, profiles=load_profiles(profile, served))
        rep, outcomes = lg.run_simulated(engine, rates, duration, arrivals, seed=seed, scale=scale)
        rep["device_preset"] = device_preset
    else:
        assert url is not None  # --url or --simulate, checked above
        rep, outcomes = lg.run_http(url, rates, duration, arrivals, seed=seed, scale=scale)
    if output:
        output.write_text(json.dumps(rep, indent=1) + "\n")
    if plot_path:
        lg.plot(rep, outcomes, plot_path)
    if as_json:
        print(json.dumps({k: v for k, v in rep.items() if k != "queue_samples"}))
    else:
        out.print(lg.table(rep))
    if output or plot_path:
        err.print(f"wrote {', '.join(str(p) for p in (output, plot_path) if p)}")


@app.command()
@guard
def blocks(models: Annotated[str, typer.Option("--models", metavar="MODEL,...", help="zoo models")] = "inception_v3,"
           "resnet50,squeezenet", image_size: ImageSizeOpt = None, cuts: CutsOpt = None, as_json: JsonOpt = False):
    """Split models into blocks at single-tensor cut points; counts beside TOP Table II."""
    from opweave import zoo
    from opweave.serve.assemble import load_models, parse_cuts, parse_image_size
    from opweave.serve.engine.blocks import table_ii

    served = load_models(_names(models), device="cpu", image_size=parse_image_size(image_size), cuts=parse_cuts(cuts))
    rows = [{**table_ii(m.blocked), "top_blocks": zoo.PAPER_COUNTS.get(n, {}).get("blocks"),
             "top_ops": zoo.PAPER_COUNTS.get(n, {}).get("ops"), "stackable": m.blocked.stackable}
            for n, m in served.items()]
    if as_json:
        print(json.dumps(rows))
        return
    t = Table(title="blocks at single-tensor cut points (TOP Table II beside)")
    for col in ("model", "ops", "cut points", "segments", "blocks", "TOP blocks", "TOP ops", "ops per block"):
        t.add_column(col, justify="left" if col in ("model", "ops per block") else "right")
    for r in rows:
        t.add_row(r["model"], str(r["ops"]), str(r["cut_points"]), str(r["segments"]), str(r["blocks"]),
                  str(r["top_blocks"] or "-"), str(r["top_ops"] or "-"), " ".join(map(str, r["ops_per_block"])))
    out.print(t)
