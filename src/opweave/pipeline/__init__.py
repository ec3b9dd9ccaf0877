"""From a captured model to a runnable, one way for every door: options (:mod:`.options`), the pipeline
(:mod:`.pipeline`), one target per device (:mod:`.targets`) and the measured choices (:mod:`.autotune`)."""

from opweave.pipeline.flow import Compiled, as_tuple, build, costs_for, plan_for, validated_plan
from opweave.pipeline.options import MODES, OPTIONS, Options, mode_options, option_table, parse_option, resolve

__all__ = ["MODES", "OPTIONS", "Compiled", "Options", "as_tuple", "build", "costs_for", "mode_options",
           "option_table", "parse_option", "plan_for", "resolve", "validated_plan"]
