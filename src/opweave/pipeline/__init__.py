"""From a captured model to a runnable, one way for every door: options (:mod:`.options`), the flow
(:mod:`.flow`), one target per device (:mod:`.targets`), the measured choices (:mod:`.autotune`, cached by
:mod:`.choices`) and the predicted ones (:mod:`.choose`: the CUDA default's plan on the fitted GPU, which
:mod:`.calibrate` fits)."""

from opweave.pipeline.flow import Compiled, as_tuple, build, costs_for, plan_for, validated_plan
from opweave.pipeline.options import MODES, OPTIONS, Options, mode_options, option_table, parse_option, resolve

__all__ = ["MODES", "OPTIONS", "Compiled", "Options", "as_tuple", "build", "costs_for", "mode_options",
           "option_table", "parse_option", "plan_for", "resolve", "validated_plan"]
