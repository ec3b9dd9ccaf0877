"""The distributed backend under ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``): this process is one rank, rank 0 is also the caller.

Rank 0 builds the model, its plan and the rank parts (``prepare``) and scatters them (``scatter_object_list``), each
part with the model inputs its rank reads. Every rank then runs the same number of calls in lockstep (a barrier
before each); after a call the other ranks send the values the output needs to rank 0, in rank order, with the
layouts rank 0 knows from the parts (after all of the call's messages: the ordering argument of
:mod:`opweave.backends.distributed` extends to them). Rank 0 times each call from the barrier to the last output
value received. Unlike the caller of :class:`~.launch.DistributedBackend`, rank 0 here holds the whole model too
(it built it); the other ranks hold their share only.

A failure raises in the rank that sees it; the launcher (torchrun) then stops the others, and a rank waiting for a
dead peer fails when its connection drops or after the process group's timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from opweave.backends.distributed import wire
from opweave.backends.distributed.launch import DEFAULT_TIMEOUT_S, check_devices
from opweave.backends.distributed.rank import RankRuntime, init_group
from opweave.backends.distributed.split import RankPart, split
from opweave.backends.threads import total_threads
from opweave.errors import OpweaveError, RankError, first_line


def launched() -> bool:
    """True when this process was started as one rank of several by torchrun (or a launcher like it)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_and_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def ranks_here() -> int:
    """How many ranks the launcher started on this node (``LOCAL_WORLD_SIZE``; the world where it does not say)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))


def run(prepare: Callable[[], tuple[Any, Any, tuple]], *, device: str = "cpu", runs: int = 10, warmup: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> dict | None:
    """Run ``warmup + runs`` calls as this rank. ``prepare()`` runs on rank 0 only and returns ``(captured, plan,
    inputs)``. ``threads``: what this rank's lanes may use in all (default: the usable cores split among the ranks on
    this node, :func:`opweave.backends.threads.total_threads`). Rank 0 returns ``{"times_ms": [...], "output": ...,
    "ranks": [info per rank]}``; others None. A failure other than an :class:`~opweave.errors.OpweaveError` (bad input,
    raised as is) is raised as :class:`~opweave.errors.RankError` naming this rank."""
    rank, _ = rank_and_world()
    try:
        result = _run(prepare, device, runs, warmup, timeout_s, threads)
    except OpweaveError:
        raise
    except Exception as exc:
        raise RankError(f"rank {rank} failed: {first_line(exc)}") from exc
    dist.destroy_process_group()
    return result


def _run(prepare, device: str, runs: int, warmup: int, timeout_s: float, threads: int | None) -> dict | None:
    rank, world = rank_and_world()
    local = int(os.environ.get("LOCAL_RANK", rank))
    threads = total_threads(threads, ranks=ranks_here())
    torch.set_num_threads(threads)
    if device == "cuda":
        check_devices(local + 1, device)
        torch.cuda.set_device(local)
    torch_device = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    init_group(rank, world, torch_device, timeout_s)
    blobs = None
    if rank == 0:
        captured, plan, inputs = prepare()
        parts = split(captured, plan, world)
        env = captured.bind(tuple(inputs))
        blobs = [wire.dumps((part, {name: env[name] for name in part.inputs})) for part in parts]
    received: list[Any] = [None]
    dist.scatter_object_list(received, blobs, src=0)
    part, inputs_here = wire.loads(received[0])
    del received, blobs
    runtime = RankRuntime(part, torch_device, threads)
    infos: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(runtime.info(), infos, dst=0)
    times, values = [], {}
    for _ in range(warmup + runs):
        dist.barrier()
        start = time.perf_counter()
        values = _collect(runtime.run(inputs_here), part, parts if rank == 0 else None, torch_device)
        times.append((time.perf_counter() - start) * 1e3)
    dist.barrier()
    if rank != 0:
        return None
    env.update({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()})
    return {"times_ms": times[warmup:], "output": captured.output(env), "ranks": infos}


def _collect(values: dict, part: RankPart, parts: list[RankPart] | None, device: torch.device) -> dict:
    """Every rank's output values at rank 0 (rank 0 returns them all; the others return an empty dict)."""
    if parts is None:
        buffers = [p for key, layout in part.outputs.items()
                   for p in wire.pack(values[key], layout, f"output value {key!r}", device)]
        for i, buffer in enumerate(buffers):
            dist.send(buffer, 0, tag=part.output_tag + i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return {}
    collected = dict(values)
    for other in parts[1:]:
        sizes = wire.part_sizes(other.outputs.values())
        buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        for i, buffer in enumerate(buffers):
            dist.recv(buffer, other.rank, tag=other.output_tag + i)
        it = iter(buffers)
        collected.update({key: wire.unpack(it, layout, device) for key, layout in other.outputs.items()})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return collected
