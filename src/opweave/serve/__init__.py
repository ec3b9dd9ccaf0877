"""Asynchronous multi-model serving (TOP §III-IV, §VI-A), in rooms that import only downward: the engine
(:mod:`.engine`: queues, policies, executors, simulation; no HTTP), what is served and how requests are spoken
(:mod:`.models`, :mod:`.protocol`, :mod:`.frontend`), the model repository (:mod:`.repository`), what the server
tells of itself (:mod:`.metrics`), the two front ends (:mod:`.http`, :mod:`.grpc`), and the server that runs them
(:mod:`.server`); a server put together from options (:mod:`.assemble`), on Ray Serve (:mod:`.ray`), and the load
generator (:mod:`.loadgen`)."""
