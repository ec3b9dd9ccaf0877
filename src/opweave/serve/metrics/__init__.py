"""What a server tells of itself: Prometheus metrics (:mod:`.prometheus`, ``GET /metrics``) and the statistics
extension (:mod:`.stats`, KServe v2's and Triton's ``statistics``), both collected through the engine's observer
hooks."""
