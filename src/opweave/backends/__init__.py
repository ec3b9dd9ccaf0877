"""Backends: what runs a :class:`~opweave.plan.LaunchPlan`. None re-decides the schedule, and none re-derives the
plan's order: which record a wait pairs with and what happens before what come from :mod:`opweave.plan.semantics`.

* :mod:`.program` — the plan split into lanes with every wait resolved, the one :class:`~.program.Walker` of their
  steps that every backend subclasses, and the :class:`~.program.Backend` protocol;
* :mod:`.liveness` — which buffers a run holds and when one that several streams read may be freed (join-aware);
* :mod:`.cache` — the one input signature and the one bounded LRU cache;
* :mod:`.simulate` — a replay under a cost model, no device; :mod:`.render` draws it;
* :mod:`.cpu` — worker threads, one per lane;
* :mod:`.streams` — one CUDA stream pool per device, and lanes on streams forked from and joined into the caller's;
* :mod:`.cuda` — the CUDA backend: lanes on streams, recorded ahead of time into a CUDA Graph (:mod:`.cudagraph`);
* :mod:`.segments` — stream segments compiled with TorchInductor (``compiler="inductor"``);
* :mod:`.distributed` — one process per device.
"""
