"""From a captured model to a runnable, one way for every door: options (:mod:`.options`, resolved once at each door,
a server's with the serving preset), the flow (:mod:`.flow`: :func:`build`, which makes a :mod:`.compiled` model),
one target per device (:mod:`.targets`, CUDA plans through the :mod:`.memory_pass`, CPU thread budgets from
:mod:`.thread_budgets`), a compiled model's other input signatures and batch sizes (:mod:`.signatures`), the measured
choices (:mod:`.autotune`, cached by :mod:`.choices`) and the predicted ones (:mod:`.choose`: the CUDA default's plan
on the fitted GPU, which :mod:`opweave.costs.calibrate` fits)."""

from opweave.pipeline.compiled import Compiled
from opweave.pipeline.flow import as_tuple, build
from opweave.pipeline.options import MODES, OPTIONS, Options, mode_options, option_table, parse_option, resolve
from opweave.pipeline.targets import costs_for
from opweave.plan.make import plan_for, validated_plan

__all__ = ["MODES", "OPTIONS", "Compiled", "Options", "as_tuple", "build", "costs_for", "mode_options",
           "option_table", "parse_option", "plan_for", "resolve", "validated_plan"]
