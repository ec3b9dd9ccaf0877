"""The gRPC front end (KServe v2's ``GRPCInferenceService`` on ``tritonclient``'s generated stubs): its messages
(:mod:`.messages`), the service (:mod:`.service`) and the server that runs it beside the HTTP one (:mod:`.server`)."""
