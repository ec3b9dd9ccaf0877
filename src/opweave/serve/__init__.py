"""Asynchronous multi-model serving (TOP §III-IV, §VI-A): blocks, the engine, its policies and executors, the
Open Inference Protocol server and the load generator."""
