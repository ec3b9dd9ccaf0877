"""Backends: what runs a :class:`~opweave.plan.LaunchPlan`. None re-decides the schedule, and none re-derives the
plan's order: which record a wait pairs with and what happens before what come from :mod:`opweave.plan.semantics`.

* :mod:`.program` — the plan split into lanes with every wait resolved (what every backend interprets);
* :mod:`.liveness` — when a buffer several streams read may be freed (join-aware);
* :mod:`.simulate` — a replay under a cost model, no device; :mod:`.render` draws it;
* :mod:`.cpu` — worker threads, one per lane;
* :mod:`.cuda` — CUDA streams, recorded ahead of time into a CUDA Graph.
"""
