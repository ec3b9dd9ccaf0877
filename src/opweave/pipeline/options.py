"""One vocabulary for every way in: :class:`Options` and :func:`resolve`.

``opweave.compile``, ``torch.compile(backend="opweave")``, the CLI's ``--option``, the serving executors and the
benchmarks all describe what they want with the same names, and :func:`resolve` checks them once, before anything
touches a device, as PyTorch's ``torch.compile`` does with ``mode`` and ``options``:

* ``mode`` is a named preset that means the same on every device (:data:`MODES`, :func:`mode_options`):
  ``"default"`` (one plan, chosen without timing anything on the device but for the CPU's guard),
  ``"reduce-overhead"`` (CUDA Graphs on: every call one graph replay), ``"max-autotune"`` (the fastest of a bounded
  set of candidates, timed on the device and cached) and ``"max-autotune-no-cudagraphs"`` (the same search, CUDA
  Graphs off). Unlike ``torch.compile``, opweave records CUDA Graphs in its default mode too: recording the launches
  ahead of time is half of what it is for (``cudagraphs=False`` turns it off).
* every other knob is one field of :class:`Options`, with one meaning, the devices it applies to and its default
  (:data:`OPTIONS`, the table docs/design.md and the README show, generated from it). A default lives in its
  :class:`Spec` alone (a value, or a rule of the device, devices and threads) and fills the resolved options the
  targets read. A knob given where it cannot be honoured (a CUDA option on the CPU, a segment compiler with several
  devices, a cost source the chosen pipeline ignores, a scheduler option the scheduler does not take) is a
  :class:`~opweave.errors.UsageError` naming it, never silently dropped.
* a server (``resolve(..., serving=...)``: the device of its executor, cpu, cuda or sim) resolves the same options
  with the **serving preset**, each option's :class:`Served` entry (the table's last column): the defaults a server
  builds its combined blocks with (TOP's ``lios``, the blocks' graphs as they are, ONNX Runtime compiling each block
  on a CPU, the simulator's contention model), and, with the reason, what it cannot honour (the cost sources,
  several devices, BatchNorm folding, ...; in simulation, anything but the plan's own options).

Options are resolved once, at the door (``opweave.compile``, the ``torch.compile`` backend, the command line, a
server), and handed down resolved: whatever derives other options from them (a target's one-lane candidate, a
search's candidates, a server's block) does so with :meth:`Options.derive`, which checks what it changes; nothing
below the doors asks which options the caller gave (``given`` is the request's record, for the doors and their
messages).

:func:`resolve` returns an :class:`Options` whose every field is set for the device (``None`` only where nothing is
chosen: no cost source, compiler or scheduler options, no link with one device, no threads on CUDA, and the CUDA
default scheduler, which the target picks with the graph in hand); a device that is not there is a
:class:`~opweave.errors.DeviceError`, raised after the options were found consistent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opweave.errors import UsageError, did_you_mean

DEVICES = ("cpu", "cuda")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILERS = ("inductor", "onnxruntime", "eager")
GRAPHS = ("fx", "onnxruntime", "inductor")
FALLBACKS = ("error", "eager")
RENAMED = {"fuse": "compiler", "fallback": "capture_fallback"}  # old keyword -> its name now
RENAMED_MODES = {"max-speed": "max-autotune", "graph": "options cudagraphs=True",
                 "streams": "options cudagraphs=False"}
SERVERS = ("cpu", "cuda", "sim")  # a server's executors: the device, or the simulator (which plans a GPU's streams)


class _Same:
    """A :class:`Served` default that is the option's own."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


@dataclass(frozen=True)
class Served:
    """What a server does with one option (the serving preset): its default there (``default``: a value, or a rule
    of the request's :class:`Options`, which read their ``serving``, the executor's device; :data:`SAME`: the
    option's own; ``text``: the rule as the table says it), and, with ``refused``, why a server takes no other value
    than that default (none at all where the default is the option's own). ``simulated``: the simulator, which times
    plans and runs no op, takes it too."""

    default: Any = SAME
    text: str = ""
    refused: str = ""
    simulated: bool = False

    def text_for(self, spec: Spec) -> str:
        """The table's cell: the serving default, or what is refused and why."""
        if self.default is SAME:
            return f"refused: {self.refused}" if self.refused else "as compiled"
        shown = self.text or Spec("", "", self.default).default_text()
        return f"{shown} only: {self.refused}" if self.refused else shown


@dataclass(frozen=True)
class Spec:
    """One option: what it means, where it applies and its default, the one the code uses: a value, or a rule (a
    function of the request's :class:`Options`: its device, devices and threads) with ``text``, the rule as the table
    says it. ``needs``: a condition besides the device, as the table prints it."""

    meaning: str
    devices: str  # "cpu", "cuda", "cpu, cuda"; "devices > 1" options say so in ``needs``
    default: Any = None
    text: str = ""
    needs: str = ""
    served: Served = Served()

    def default_for(self, options: Options) -> Any:
        """The default of this option for ``options`` (the values its rule reads are filled in first): a server's
        (:class:`Served`) where ``options`` are a server's and it has one."""
        default = self.default
        if options.serving is not None and self.served.default is not SAME:
            default = self.served.default
        return default(options) if callable(default) else default

    def default_text(self) -> str:
        """The default as the options table prints it."""
        if self.text:
            return self.text
        value = self.default
        if isinstance(value, bool) or value is None:
            return {True: "true", False: "false", None: "none"}[value]
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)


def _scheduler(o: Options) -> str | None:
    if o.devices > 1:
        return "hios-lp"
    return "heft" if o.device == "cpu" else None  # CUDA: the target picks it with the graph in hand


def _streams(o: Options) -> int | None:
    if o.devices > 1:
        return None  # every stream the scheduler wants on each device
    if o.device == "cpu":
        from opweave.backends.threads import total_threads

        return total_threads(o.threads)
    from opweave.backends.streams import default_streams

    return default_streams()


def _threads(o: Options) -> int | None:
    from opweave.backends.threads import total_threads

    return total_threads(ranks=o.devices) if o.device == "cpu" else None


def _tiers(o: Options) -> bool:
    return o.device == "cpu" and os.environ.get("OPWEAVE_TIERS", "1") != "0"


def _runtime(o: Options) -> Any:
    from opweave.backends.runtime import CUDA

    return CUDA if o.device == "cuda" else None


def _link(o: Options) -> Any:
    if o.devices == 1 or o.costs is not None and o.costs.edge_transfer_ms:
        return None  # one device; or the given costs' own transfer times
    return {"cpu": "loopback", "cuda": "nvlink4"}[o.device]


def _serving_compiler(o: Options) -> str | None:
    if o.serving != "cpu":
        return None
    from opweave.backends.compilers import available

    return "onnxruntime" if "onnxruntime" in available() else None  # faster than eager blocks: docs/serving.md


ONE_DEVICE = "the engine runs every combined block on one device"
BLOCK_GRAPHS = "blocks are cut between the model's fx nodes, and their graphs scheduled as they are"
COSTED_BY_ENGINE = "the engine costs every combined block, a new graph, itself"


OPTIONS: dict[str, Spec] = {
    "scheduler": Spec("the scheduler that places ops on streams (opweave.schedulers.names())", "cpu, cuda",
                      _scheduler, "cpu: the fastest of the model as one ONNX Runtime segment (when installed) and "
                      "the model itself, timed (heft's lanes too with 4 threads or more, or without ONNX Runtime); "
                      "cuda: the simulator's pick; hios-lp with devices > 1",
                      served=Served(lambda o: "heft" if o.serving == "cpu" and o.compiler else "lios",
                                    "lios (TOP's); cpu with a compiler: heft (the parts side by side)",
                                    simulated=True)),
    "streams": Spec("at most this many streams (CPU: lanes) per device", "cpu, cuda", _streams,
                    "cpu: one per thread of `threads`; cuda: 8 (CUDA_DEVICE_MAX_CONNECTIONS); with devices > 1, as "
                    "many as the scheduler makes", served=Served(simulated=True)),
    "devices": Spec("devices the plan spans (one rank process each; hios-lp or hios-mr)", "cpu, cuda", 1,
                    served=Served(1, refused=ONE_DEVICE, simulated=True)),
    "costs": Spec("a Costs object to schedule on", "cpu, cuda", None,
                  "none: a profile if given, else the roofline estimate (cuda: the fitted GPU's op times)",
                  served=Served(refused=COSTED_BY_ENGINE)),
    "profile": Spec("a profile file written by `opweave profile` to schedule on", "cpu, cuda",
                    served=Served(refused=COSTED_BY_ENGINE)),
    "cost_model": Spec("how costs turn a plan into time: ideal (the papers') or gpu (contention)", "cpu, cuda",
                       "ideal", served=Served(lambda o: "gpu" if o.serving == "sim" else "ideal",
                                              "sim: gpu (concurrent ops share the device); cpu, cuda: ideal",
                                              simulated=True)),
    "coarsen": Spec("schedule the papers' operators (each op merged with its epilogues) instead of fx nodes",
                    "cpu, cuda", True, served=Served(False, refused=BLOCK_GRAPHS, simulated=True)),
    "fold_bn": Spec("fold eval-mode BatchNorm into the convolution before capture", "cpu, cuda", False,
                    served=Served(refused="the server captures each model as it is, its blocks cut between fx "
                                          "nodes")),
    "graph": Spec("the graph that is scheduled: fx (opweave's capture), onnxruntime (CPU: ONNX Runtime's optimized "
                  "graph of the whole model, each segment one session) or inductor (one op per kernel Inductor fuses "
                  "in the whole model, each segment compiled by Inductor)", "cpu, cuda", "fx",
                  served=Served("fx", refused=BLOCK_GRAPHS, simulated=True)),
    "compiler": Spec("the segment compiler: every stream segment of the plan compiled by inductor, onnxruntime "
                     "(CPU) or eager (the segments as they are); none: no compiler", "cpu, cuda", None,
                     "none (cpu: the default plan tries onnxruntime when installed)",
                     served=Served(_serving_compiler, "cpu: onnxruntime where installed (each block compiled whole), "
                                                      "else none")),
    "scheduler_options": Spec("keyword options of the scheduler (e.g. heft's sync_ms)", "cpu, cuda",
                              served=Served(simulated=True)),
    "threads": Spec("CPU threads each device's lanes may use in all (lanes x intra-op threads), on every CPU path",
                    "cpu", _threads, "every core this process may use (split among the ranks with devices > 1)"),
    "cudagraphs": Spec("record the plan into a CUDA Graph per input signature (false: run the streams live)",
                       "cuda", lambda o: o.device == "cuda" and o.devices == 1, "true (false with devices > 1)"),
    "capture_fallback": Spec("error: a plan that cannot be recorded is an error; eager: that signature runs on "
                             "streams without a graph, with a warning", "cuda", "error", needs="cudagraphs"),
    "static_outputs": Spec("return the graph's own output tensors (overwritten by the next call) instead of "
                           "clones", "cuda", False, needs="cudagraphs",
                           served=Served(refused="an instance keeps a block's outputs until its next block runs")),
    "dynamic": Spec("a call whose inputs differ from the example's: other sizes run the plan built, checked "
                    "against the model once per dimension that changes (true: every size free in segment "
                    "compilers from the first build), another dtype or structure is built for (true, or unset); "
                    "false refuses both", "cpu, cuda", None,
                    "unset: a size becomes free at its second value",
                    served=Served(refused="a server takes the batch sizes its models' configs allow, up to "
                                          "max_batch_size, and refuses other shapes by the config")),
    "tiers": Spec("after the first tier answers, build the other tiers off the caller's path (ONNX Runtime's session "
                  "at the example's sizes, then the model compiled by Inductor with freezing; in a build process, "
                  "cached on disk) and move calls to one once "
                  "it is measured faster; false: the first tier only", "cpu", _tiers,
                  "true (false where OPWEAVE_TIERS=0 is set)", needs="the CPU default",
                  served=Served(False, refused="a server's blocks keep their first tier")),
    "cache_size": Spec("plans built for other input signatures besides the example's (past it such a signature "
                       "runs on the model itself, with a warning; on CUDA also the recordings kept per "
                       "signature)", "cpu, cuda", 8,
                       served=Served(lambda o: {"cpu": 32, "cuda": 64}.get(o.serving, 1 << 16),
                                     "combined blocks kept built, and on a cpu each block's batch sizes: cpu 32, "
                                     "cuda 64 (each one CUDA Graph)")),
    "buckets": Spec("pad a call's batch (dimension 0 of every tensor input) up to the next of these sizes, its "
                    "outputs cut back: pow2 (powers of two) or a list of sizes", "cpu, cuda", None,
                    "none: every batch runs at its size",
                    served=Served(refused="a server pads the batches it forms to its blocks' own batch variants")),
    "runtime": Spec("what the CUDA backend reaches CUDA through: torch.cuda, or opweave.testing.FakeCuda() to run "
                    "the whole CUDA path on the CPU (tests, no GPU)", "cuda", _runtime, "torch.cuda"),
    "warmup": Spec("plain runs before recording a signature", "cuda", 2, needs="cudagraphs"),
    "link": Spec("the link between devices: a preset or a file written by `opweave profile-links`", "cpu, cuda",
                 _link, "cpu: loopback; cuda: nvlink4 (none: the transfer times of the costs given)",
                 needs="devices > 1", served=Served(refused=ONE_DEVICE)),
    "timeout_s": Spec("how long a rank may take to start or answer", "cpu, cuda", 300.0, needs="devices > 1",
                      served=Served(refused=ONE_DEVICE)),
    "start_method": Spec("how rank processes start (forkserver or spawn)", "cpu, cuda", "forkserver",
                         needs="devices > 1", served=Served(refused=ONE_DEVICE)),
}


class _Unset(frozenset[str]):
    """``Options.given`` when the caller did not say: every option passed to the constructor."""


UNFILLED: Any = None  # a field not given: filled from its Spec's default when the Options are made


@dataclass(frozen=True)
class Options:
    """Every option of :data:`OPTIONS`, checked (:func:`resolve`, :meth:`derive`) and with each default filled in from
    its :class:`Spec` for the device (a field left unset is filled when the object is made: a default lives in
    :data:`OPTIONS` alone; a server's, ``serving`` set, from the serving preset).

    Three kinds of field, kept apart:

    * **what is asked**: ``device``, ``mode``, ``serving`` (a server's executor: cpu, cuda or sim) and the options of
      the table; ``given`` names those the caller set (not the mode's or the defaults; made directly, every option
      passed). A few options are handles rather than settings (:data:`HANDLES`: a ``Costs`` object, a CUDA runtime, a
      link): objects a build uses, never part of what a cached choice is keyed by.
    * **what a build derives** (:data:`DERIVED`, set by :meth:`derive` only, never by a user): ``autotune`` (the
      mode's measured search; a candidate of the search is built with it off), ``per_op_threads`` (what runs the ops
      sleeps when idle: a server's whole blocks) and ``shared`` (many models share this process: a server's).
    * **what follows from the rest**: :attr:`guard`."""

    device: str = "cpu"
    mode: str = "default"
    autotune: bool | None = None  # None: the mode's ("max-autotune*")
    scheduler: str | None = None  # None once filled: the CUDA target chooses with the graph in hand
    streams: int | None = None  # None once filled: as many as the scheduler makes (devices > 1)
    devices: int = UNFILLED
    costs: Any = None
    profile: str | Path | None = None
    cost_model: str = UNFILLED
    coarsen: bool = UNFILLED
    fold_bn: bool = UNFILLED
    graph: str = UNFILLED
    compiler: str | None = None
    scheduler_options: dict[str, Any] | None = None
    threads: int | None = None  # None once filled: not on a CPU
    cudagraphs: bool = UNFILLED
    capture_fallback: str = UNFILLED
    static_outputs: bool = UNFILLED
    dynamic: bool | None = None
    tiers: bool = UNFILLED
    cache_size: int = UNFILLED
    buckets: str | tuple[int, ...] | None = None  # "pow2" or sizes, ascending (resolve normalizes a list)
    runtime: Any = None
    warmup: int = UNFILLED
    link: Any = None  # a preset name, a profile-links file or an opweave.costs.links.Link; None with one device
    timeout_s: float = UNFILLED
    start_method: str = UNFILLED
    per_op_threads: bool | None = None  # what runs the ops sleeps when idle (a server's whole blocks); None: ask it
    shared: bool | None = None  # many models share this process (None: a server's options)
    serving: str | None = None  # a server's executor (cpu, cuda, sim): the serving preset's defaults
    given: frozenset[str] = _Unset()

    def __post_init__(self) -> None:
        passed = frozenset(key for key in OPTIONS if getattr(self, key) is not None)
        given = passed if isinstance(self.given, _Unset) else self.given
        if self.autotune is None:
            object.__setattr__(self, "autotune", bool(mode_options(self.mode).get("autotune")))
        # values first, rules after them (they read them), the compiler's first (a server's scheduler reads it)
        rules = sorted(OPTIONS.items(), key=lambda item: (callable(item[1].default) or callable(
            item[1].served.default), item[0] != "compiler"))
        for key, spec in rules:
            if getattr(self, key) is None and key not in given - passed:  # a None given ("none") stays None
                object.__setattr__(self, key, spec.default_for(self))
        object.__setattr__(self, "given", given)
        if self.shared is None:
            object.__setattr__(self, "shared", self.serving is not None)

    @property
    def guard(self) -> bool:
        """Whether the build is the CPU default's race (:mod:`opweave.pipeline.search`): one CPU device, no search,
        no server, and nothing about the plan asked for (:data:`PLAN_KEYS`)."""
        planned = {key for key in PLAN_KEYS & self.given if getattr(self, key) is not None}  # no compiler: default's
        return self.device == "cpu" and self.devices == 1 and not self.autotune and self.serving is None and not planned

    def asked(self) -> dict[str, Any]:
        """What was asked, as :func:`resolve` takes it: each option of ``given`` with its value (None: no compiler)."""
        return {key: getattr(self, key) for key in OPTIONS if key in self.given}

    def derive(self, **changes: Any) -> Options:
        """These options with ``changes`` (options of the table, None for one: back to its default, but for
        ``compiler``: none; and what a build derives, :data:`DERIVED`), checked by the rules :func:`resolve` checks,
        every rule across options included: a change :func:`resolve` would refuse with the options asked so far is
        refused here with the same message. What a target, a search or a server derives from the resolved options (a
        candidate's plan, a block's build). The changes join what was asked (``given``)."""
        if changes.get("compiler") == "none":
            changes = {**changes, "compiler": None}
        _check_names({k: v for k, v in changes.items() if k not in DERIVED})
        hints = {key: changes.pop(key, getattr(self, key)) for key in DERIVED}
        for key, value in hints.items():
            if not isinstance(value, bool) and not (key != "autotune" and value is None):
                raise UsageError(f"{key!r} must be true or false, got {value!r}")
        asked = self.asked()
        for key, value in changes.items():
            if value is None and key != "compiler":
                asked.pop(key, None)
            else:
                asked[key] = value
        return _made(self.device, self.mode, self.serving, asked, **hints)


PLAN_KEYS = frozenset({"scheduler", "streams", "compiler", "graph"})  # given, the plan is the caller's: no guard
DERIVED = frozenset({"autotune", "per_op_threads", "shared"})  # what Options.derive may change besides the options
HANDLES = frozenset({"costs", "runtime", "link"})  # options that are objects a build uses, not settings


def mode_options(mode: str) -> dict[str, Any]:
    """What ``mode`` sets (as ``torch._inductor.list_mode_options``); the device defaults are :func:`resolve`'s."""
    if not isinstance(mode, str) or mode not in MODES:
        hint = (f" (now {RENAMED_MODES[mode]!r})" if isinstance(mode, str) and mode in RENAMED_MODES
                else did_you_mean(mode, MODES))
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}{hint}")
    return {"default": {}, "reduce-overhead": {"cudagraphs": True}, "max-autotune": {"autotune": True},
            "max-autotune-no-cudagraphs": {"autotune": True, "cudagraphs": False}}[mode]


def resolve(device: str = "cpu", mode: str | None = "default", options: dict[str, Any] | None = None, *,
            check_device: bool = True, serving: str | None = None, **given: Any) -> Options:
    """The checked :class:`Options` for ``device`` from ``mode``, ``options`` and keyword options (the same names;
    one given both ways is an error; None: not given). Every refusal is a :class:`~opweave.errors.UsageError` naming
    the option; with ``check_device``, a CUDA device that is not there is a :class:`~opweave.errors.DeviceError`,
    raised only once the options are found consistent. ``serving``: the options of a server whose executor runs on
    that device (cpu, cuda; sim: the simulator, ``device`` cuda), resolved with the serving preset
    (:class:`Served`), what a server cannot honour refused with the reason. The rules are :func:`_checked`'s, which
    :meth:`Options.derive` runs too."""
    if device not in DEVICES:
        raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {device!r}{did_you_mean(device, DEVICES)}")
    if serving is not None and serving not in SERVERS:
        raise UsageError(f"device must be one of {', '.join(SERVERS)}, got {serving!r}{did_you_mean(serving, SERVERS)}")
    if serving is not None and device != ("cpu" if serving == "cpu" else "cuda"):
        raise UsageError(f"a server on {serving} resolves its options for {'cpu' if serving == 'cpu' else 'cuda'}, "
                         f"not {device}")
    mode = mode or "default"
    if serving is not None and mode_options(mode).get("autotune"):
        raise UsageError(f"mode={mode!r} does not apply to serving: a server builds a plan for every combination of "
                         "blocks its load brings, which a search timed on one model cannot choose; use "
                         "mode='default' (on a GPU, 'reduce-overhead' records CUDA Graphs as the default does)")
    options = {k: v for k, v in (options or {}).items() if v is not None}  # None: not given
    given = {k: v for k, v in given.items() if v is not None}
    both = sorted(set(options) & set(given))
    if both:
        raise UsageError(f"option {both[0]!r} given both as a keyword and in options")
    asked = {**options, **given}
    if asked.get("compiler") == "none":  # no segment compiler, asked for (a server's default is one)
        asked["compiler"] = None
    _check_names(asked)
    opts = _made(device, mode, serving, asked)
    if check_device and device == "cuda":
        from opweave.backends.cuda import require_cuda
        from opweave.backends.runtime import CUDA

        require_cuda(opts.runtime or CUDA)
    return opts


def _check_names(asked: dict[str, Any]) -> None:
    """An unknown option's name refused, with the name it has now or the one it was likely meant to be."""
    for key in asked:
        if key not in OPTIONS:
            hint = (f" (now {RENAMED[key]!r})" if key in RENAMED else
                    " (now a preset: mode='default', 'reduce-overhead' or 'max-autotune'; CUDA Graphs on or off is "
                    "options cudagraphs=True/False)" if key == "mode" else "")
            hint = hint or did_you_mean(key, OPTIONS)
            raise UsageError(f"unknown option {key!r}{hint}; options: {', '.join(OPTIONS)}")


def _made(device: str, mode: str, serving: str | None, asked: dict[str, Any], *, autotune: bool | None = None,
          per_op_threads: bool | None = None, shared: bool | None = None) -> Options:
    """The :class:`Options` of what was ``asked`` (known names; None only for ``compiler``: no compiler), once
    :func:`_checked` finds it consistent: what :func:`resolve` and :meth:`Options.derive` both make."""
    preset = mode_options(mode)
    autotune = bool(preset.get("autotune")) if autotune is None else autotune
    set_keys = set(asked)
    values = _checked(device, mode, serving, autotune, {k: v for k, v in asked.items() if v is not None}, set_keys)
    cudagraphs: Any = values.pop("cudagraphs", preset.get("cudagraphs")) if device == "cuda" else False
    opts = Options(device=device, mode=mode, autotune=autotune, cudagraphs=cudagraphs, serving=serving,
                   per_op_threads=per_op_threads, shared=shared, given=frozenset(set_keys), **values)
    if device == "cuda" and not opts.cudagraphs:
        for key in ("capture_fallback", "static_outputs", "warmup"):
            if key in set_keys:
                raise UsageError(f"option {key!r} applies when CUDA Graphs are recorded (cudagraphs=True)")
    _check_scheduler_options(opts)
    return opts


def _checked(device: str, mode: str, serving: str | None, autotune: bool, values: dict[str, Any],
             set_keys: set[str]) -> dict[str, Any]:
    """Every rule across options, for ``values`` (the options asked, None left out) of which ``set_keys`` were
    asked: the values to make :class:`Options` from (``buckets`` as sizes, what ``graph="inductor"`` implies), or a
    :class:`~opweave.errors.UsageError` naming the option."""
    preset = mode_options(mode)
    _check_values(values)
    if "buckets" in values:
        values["buckets"] = buckets_of(values["buckets"])
    cuda = device == "cuda"
    devices = values.get("devices", 1)
    for key in sorted(set_keys):
        spec = OPTIONS[key]
        if device not in spec.devices:
            raise UsageError(f"option {key!r} applies to device={spec.devices!r} only, not {device!r}")
    ranks = devices > 1
    for key in ("link", "timeout_s", "start_method"):
        if key in set_keys and not ranks:
            raise UsageError(f"option {key!r} applies to plans over several devices (devices > 1)")
    if ranks:
        from opweave import schedulers

        for key in ("compiler", "graph", "cudagraphs", "static_outputs", "capture_fallback", "cache_size", "warmup"):
            if key in set_keys and not (key == "cudagraphs" and values[key] is False):
                raise UsageError(f"option {key!r} applies to one device; devices={devices} runs each rank's ops "
                                 "unfused on streams")
        if values.get("scheduler") is not None and values["scheduler"] not in schedulers.MULTI_DEVICE:
            raise UsageError(f"scheduler {values['scheduler']!r} places every op on one device; use one of "
                             f"{', '.join(schedulers.MULTI_DEVICE)} with devices > 1")
    if autotune:
        chosen = [k for k in ("scheduler", "streams", "costs", "profile", "cost_model", "compiler", "graph",
                              "scheduler_options", "devices", "tiers") if k in set_keys]
        if chosen:
            raise UsageError(f"mode={mode!r} chooses the plan itself: give no {chosen[0]!r}")
    if preset.get("cudagraphs") is not None and "cudagraphs" in set_keys and values["cudagraphs"] != preset[
            "cudagraphs"]:
        raise UsageError(f"mode={mode!r} sets cudagraphs={preset['cudagraphs']}; cudagraphs={values['cudagraphs']} "
                         "contradicts it")
    if mode == "reduce-overhead" and not cuda:
        raise UsageError("mode='reduce-overhead' records CUDA Graphs, which the CPU does not have; use "
                         "mode='default' (the CPU's lanes are generated code already)")
    if mode == "reduce-overhead" and ranks:
        raise UsageError(f"mode='reduce-overhead' records CUDA Graphs, which devices={devices} does not (each rank "
                         "runs its streams live); use mode='default'")
    graph = values.get("graph", "fx")
    if graph == "onnxruntime":
        if cuda:
            raise UsageError("option 'graph'='onnxruntime' runs ONNX Runtime sessions on the CPU; on CUDA use "
                             "graph='inductor'")
        for key in ("compiler", "profile", "cost_model", "costs"):
            if key in set_keys:
                raise UsageError(f"option {key!r} does not apply with graph='onnxruntime' (ONNX Runtime's graph is "
                                 "costed by its own profiler and run as sessions)")
    if graph == "inductor":
        for key, why in (("compiler", "every segment is compiled by Inductor"),
                         ("coarsen", "its ops are Inductor's kernels"),
                         ("costs", "its ops are known only once Inductor has fused the model"),
                         ("profile", "its ops are known only once Inductor has fused the model")):
            if key in set_keys and not (key == "compiler" and values.get(key) == "inductor"
                                        or key == "coarsen" and values.get(key) is False):
                raise UsageError(f"option {key!r} does not apply with graph='inductor' ({why})")
        values = {**values, "compiler": "inductor", "coarsen": False}
    if values.get("compiler") == "onnxruntime" and cuda:
        raise UsageError("compiler='onnxruntime' runs segments on the CPU; on CUDA use compiler='inductor'")
    if "costs" in set_keys and "profile" in set_keys:
        raise UsageError("give costs or profile, not both")
    planned = sorted(k for k in PLAN_KEYS & set_keys if values.get(k) is not None)
    if values.get("tiers") and (planned or ranks):
        raise UsageError(f"option 'tiers' applies to the CPU default, whose plan it may replace: give no "
                         f"{planned[0] if planned else 'devices'!r}")
    if serving is not None:
        _check_served(serving, values, set_keys)
    return values


def _check_scheduler_options(options: Options) -> None:
    """Scheduler options the scheduler that will run does not take, refused at the door: the scheduler given, or the
    default one (the CPU's heft, a server's, the ranks' hios-lp); on CUDA without one, the simulator picks among the
    schedulers that take them all, so some must."""
    if not options.scheduler_options:
        return
    from opweave import schedulers

    if options.scheduler is not None:
        schedulers.check_options(options.scheduler, options.scheduler_options)
        return
    asked = set(options.scheduler_options)
    if not any((taken := schedulers.options_of(name)) is None or asked <= taken for name in schedulers.names()
               if name not in schedulers.MULTI_DEVICE):
        raise UsageError(f"no scheduler takes the options {', '.join(sorted(asked))}; give the scheduler they are for")


def _check_served(serving: str, values: dict[str, Any], given: set[str]) -> None:
    """What a server on ``serving`` cannot honour of the options ``given`` (their ``values``), refused with the
    reason (:class:`Served`)."""
    for key in sorted(given):
        served = OPTIONS[key].served
        why = ""
        if serving == "sim" and not served.simulated:
            why = "the simulator times plans, it runs no op"
        elif served.refused and (served.default is SAME or callable(served.default)
                                 or values.get(key) != served.default):
            why = served.refused
        if why:
            raise UsageError(f"option {key!r} does not apply to serving on {serving}: {why}")


def _check_values(values: dict[str, Any]) -> None:
    """Each given value's type and range, one line naming the option."""

    def fail(key: str, want: str, names: Any = ()) -> None:
        raise UsageError(f"option {key!r} must be {want}, got {values[key]!r}{did_you_mean(values[key], names)}")

    def integer(key: str, low: int) -> None:
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < low):
            fail(key, f"an integer >= {low}")

    for key in ("coarsen", "fold_bn", "cudagraphs", "static_outputs", "dynamic", "tiers"):
        if key in values and not isinstance(values[key], bool):
            fail(key, "true or false")
    integer("streams", 1)
    integer("devices", 1)
    integer("threads", 1)
    integer("cache_size", 1)
    integer("warmup", 1)
    if "timeout_s" in values and (isinstance(values["timeout_s"], bool)
                                  or not isinstance(values["timeout_s"], (int, float)) or values["timeout_s"] <= 0):
        fail("timeout_s", "a positive number of seconds")
    choices = {"graph": GRAPHS, "compiler": (*COMPILERS, "none"), "capture_fallback": FALLBACKS,
               "start_method": ("forkserver", "spawn")}
    for key, allowed in choices.items():
        if key in values and values[key] not in allowed:
            fail(key, "one of " + ", ".join(allowed), allowed)
    if "cost_model" in values:
        from opweave.costs import COST_MODELS

        if values["cost_model"] not in COST_MODELS:
            fail("cost_model", "one of " + ", ".join(COST_MODELS), COST_MODELS)
    if "scheduler" in values:
        from opweave import schedulers

        if values["scheduler"] not in schedulers.names():
            fail("scheduler", "one of " + ", ".join(schedulers.names()), schedulers.names())
    if "scheduler_options" in values and not isinstance(values["scheduler_options"], dict):
        fail("scheduler_options", "a dict of the scheduler's keyword options")
    if "runtime" in values and not all(hasattr(values["runtime"], a) for a in ("launch", "is_available", "Stream")):
        fail("runtime", "a CUDA runtime (opweave.backends.runtime.CUDA or opweave.testing.FakeCuda())")
    if "costs" in values:
        from opweave.costs import Costs

        if not isinstance(values["costs"], Costs):
            fail("costs", "an opweave.costs.Costs")
    if "profile" in values and not isinstance(values["profile"], (str, Path)):
        fail("profile", "a path")
    if "link" in values:
        from opweave.costs.links import Link

        if not isinstance(values["link"], (str, Path, Link)):
            fail("link", "a preset name, a file written by `opweave profile-links` or a Link")


def buckets_of(value: Any) -> str | tuple[int, ...]:
    """The ``buckets`` option as :class:`Options` holds it: ``"pow2"``, or the sizes ascending (a list, or the
    command line's ``8,16,32``); :class:`~opweave.errors.UsageError` otherwise."""
    if value == "pow2":
        return "pow2"
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            value = None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise UsageError(f"option 'buckets' must be 'pow2' or a list of sizes >= 1, got {value!r}")
    return tuple(sorted(set(value)))


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line (``--option``): true/false, none, integers and numbers become Python
    values, the rest stays a string; ``scheduler_options`` takes JSON."""
    import json

    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise UsageError(f"--option takes KEY=VALUE, got {text!r}")
    raw = raw.strip()
    if key == "scheduler_options":
        try:
            return key, json.loads(raw)
        except ValueError as exc:
            raise UsageError(f"--option scheduler_options takes JSON, got {raw!r}") from exc
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if lowered == "none":
        return key, None
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def option_table() -> list[dict[str, str]]:
    """Every option as a row (name, meaning, devices, default, needs, served): the table the docs show, the defaults
    the code fills in (:meth:`Spec.default_text`) and a server's (:meth:`Served.text_for`)."""
    return [{"name": name, "meaning": spec.meaning, "devices": spec.devices, "default": spec.default_text(),
             "needs": spec.needs, "served": spec.served.text_for(spec)} for name, spec in OPTIONS.items()]


def serving_preset(serving: str) -> dict[str, Any]:
    """What the serving preset sets for a server on ``serving`` (cpu, cuda, sim) where it differs from a compile's
    defaults, as :func:`mode_options` lists a mode's."""
    device = "cpu" if serving == "cpu" else "cuda"
    served, compiled = resolve(device, serving=serving, check_device=False), resolve(device, check_device=False)
    return {key: getattr(served, key) for key in OPTIONS if getattr(served, key) != getattr(compiled, key)}


def options_markdown() -> str:
    """:func:`option_table` as the Markdown table docs/design.md and the README carry (a test keeps them equal)."""
    rows = ["| option | meaning | devices | default | served (opweave serve) |", "| --- | --- | --- | --- | --- |"]
    for row in option_table():
        needs = f" (with {row['needs']})" if row["needs"] else ""
        rows.append(f"| `{row['name']}` | {row['meaning']}{needs} | {row['devices']} | {row['default']} | "
                    f"{row['served']} |")
    return "\n".join(rows)


__all__ = ["DEVICES", "MODES", "OPTIONS", "SERVERS", "Options", "Served", "buckets_of", "mode_options",
           "option_table", "options_markdown", "parse_option", "resolve", "serving_preset"]
