"""Backends: what runs a :class:`~opweave.plan.LaunchPlan`. None re-decides the schedule, and none re-derives the
plan's order: which record a wait pairs with and what happens before what come from :mod:`opweave.plan.semantics`.

* :mod:`.program` — the plan split into lanes with every wait resolved, the one :class:`~.program.Walker` of their
  steps that every backend subclasses, and the :class:`~.program.Backend` protocol;
* :mod:`.liveness` — which buffers a run holds and when one that several streams read may be freed (join-aware);
* :mod:`.cache` — the one input signature and the one bounded LRU cache;
* :mod:`.simulate` — a replay under a cost model, no device; :mod:`.render` draws it;
* :mod:`.threads` — the CPU's thread budgets (lanes x intra-op threads never above the cores);
* :mod:`.lanecode` — each CPU lane generated as one Python function; :mod:`.cpu` — the caller's thread and one
  worker thread per other lane run them;
* :mod:`.streams` — one CUDA stream pool per device, and lanes on streams forked from and joined into the caller's;
* :mod:`.cuda` — the CUDA backend: lanes on streams, recorded ahead of time into a CUDA Graph (:mod:`.cudagraph`);
* :mod:`.segments` — stream segments, each compiled as one graph by a segment compiler (:mod:`.compilers`:
  TorchInductor, ONNX Runtime);
* :mod:`.ortgraph` — lanes over ONNX Runtime's optimized graph of the whole model, each segment one session;
* :mod:`.distributed` — one process per device.

Which backend runs a model, with which options, is :mod:`opweave.pipeline`'s decision, not theirs.
"""
