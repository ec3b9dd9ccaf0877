"""The serving engine (TOP §IV, §VI-A), with no HTTP and no gRPC: the engine itself (:mod:`.engine`: queues, the
task launcher, instances, combined blocks chosen by a policy), a request's life in it (:mod:`.requests`), what it
runs on (:mod:`.executors`, :mod:`.cpu`, :mod:`.cuda`: combined blocks of :mod:`.blocks` and :mod:`.combined`, built
by the pipeline), its policies (:mod:`.policy`, :mod:`.policies`, :mod:`.top`) and its simulation
(:mod:`.simulation`)."""

from opweave.serve.engine.engine import Engine
from opweave.serve.engine.requests import Instance, Observer, QueueFull, Request, Unavailable
from opweave.serve.engine.simulation import Arrival, SimRun, Simulation, simulate_arrivals

__all__ = ["Arrival", "Engine", "Instance", "Observer", "QueueFull", "Request", "SimRun", "Simulation", "Unavailable",
           "simulate_arrivals"]
