"""The errors opweave raises on purpose, one family under :class:`OpweaveError` (as networkx's ``NetworkXError``).

Each is a bad input or an unmet precondition, reported by the CLI as one line and exit status 2; anything else
that escapes is a bug and keeps its traceback. Each also derives from the builtin it refines (``ValueError`` or
``RuntimeError``), so ``except ValueError`` written before this family existed still catches it.

========================  =================================================================================
``GraphError``            a malformed operator graph (names the offending op or edge)
``ScheduleError``         a schedule that does not fit its graph
``PlanError``             a launch plan that would race or is malformed (names the edge or instruction)
``CaptureError``          a model that cannot be captured, or an op that fails while running (names the op)
``ProfileError``          a profile measured for something else, or a measurement that cannot be trusted
``UsageError``            a bad argument or option combination, an unknown name
``MissingPackageError``   an optional package (torchvision, timm, transformers, ...) that is not installed
``DeviceError``           a device that is not there or cannot do what was asked (no CUDA, too few GPUs)
``RankError``             a rank of a multi-device run that raised or died (names the rank and the cause)
========================  =================================================================================
"""

from __future__ import annotations


class OpweaveError(Exception):
    """Base of every error opweave raises on purpose."""


class GraphError(OpweaveError, ValueError):
    """A malformed graph; the message is one line naming the offending id."""


class ScheduleError(OpweaveError, ValueError):
    """A schedule that does not fit its graph."""


class PlanError(OpweaveError, ValueError):
    """A plan that would race or is malformed; the message names the offending edge or instruction."""


class CaptureError(OpweaveError, RuntimeError):
    """The model could not be captured or one of its ops failed; the message names the model or op and why."""


class ProfileError(OpweaveError, ValueError):
    """A profile that does not fit (model, shapes, dtype, device, torch) or a measurement that cannot be trusted."""


class UsageError(OpweaveError, ValueError):
    """Bad input from a caller: an unknown name, an option out of range, options that do not go together."""


class MissingPackageError(UsageError, ImportError):
    """An optional package needed for what was asked is not installed (or does not import)."""


class DeviceError(OpweaveError, RuntimeError):
    """A device that is not available, or fewer devices than asked for."""


class RankError(DeviceError):
    """A rank process of a multi-device run raised or died; every rank was stopped. Names the rank and the cause."""


def did_you_mean(name: object, choices) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is a likely misspelling of one of ``choices``, else ``""``: the hint an
    error about an unknown name carries.

    >>> did_you_mean("lois", ["lios", "opara"]), did_you_mean("zzz", ["lios"])
    (" (did you mean 'lios'?)", '')
    """
    import difflib

    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of its message"`` (at most ``limit`` characters of the line): how an error that
    opweave reports on someone else's behalf (a candidate that failed, a rank, a segment compiler) is told in one
    line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}"


__all__ = ["CaptureError", "DeviceError", "GraphError", "MissingPackageError", "OpweaveError", "PlanError",
           "did_you_mean",
           "ProfileError", "RankError", "ScheduleError", "UsageError", "first_line"]
