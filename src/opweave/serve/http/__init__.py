"""The HTTP front end: the Open Inference Protocol's routes (:mod:`.app`), the checks in front of them (:mod:`.guard`),
what a connection may hold (:mod:`.transport`) and the uvicorn server that runs them, draining on SIGTERM
(:mod:`.server`)."""
