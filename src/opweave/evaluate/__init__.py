"""opweave held against eager PyTorch on real models: how fast (:mod:`.bench`, the real-run timing that
``opweave bench`` and the benchmarks share) and whether right (:mod:`.coverage`, the third-party model list and the
per-model check that ``tests/test_third_party.py`` and ``benchmarks/coverage.py`` share).

Named ``evaluate`` rather than ``eval``: a module named after Python's builtin reads as that builtin, and
``from opweave import eval`` would hide it in the importing module. It sits beside ``dynamo`` and ``serve``, above
``api`` (it compiles models with :func:`opweave.api.compile_captured`) and below ``cli``.
"""
