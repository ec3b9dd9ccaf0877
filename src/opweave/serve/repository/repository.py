"""The model repository (Triton's layout, :mod:`~opweave.serve.repository.layout`, and repository extension):
models that come and go while the server runs.

:meth:`Repository.load` and :meth:`Repository.unload` are slow (seconds) and blocking: the front ends call them on a
worker thread, never on their event loop, and they never hold the engine's lock while they capture or compile. A
load captures, splits and checks the program, compiles its blocks (``executor.warm_model``), and only then links it
into the engine (:meth:`Engine.add_model`, atomic); the other models are served all the while. An unload takes the
model out of :attr:`Repository.served` (new requests: 404), stops its queue (a request that raced the lookup: 503),
answers every request it had accepted, then the engine drops it between two steps (:meth:`Engine.remove_model`), and
the memory it held is given back (:func:`~opweave.serve.frontend.release_memory`: its graphs hold reference cycles,
which only Python's collector frees).
Loading a model that is served reloads it only if its version or its config changed (a load without
``parameters.config`` takes the repository's ``config.pbtxt``, so it undoes an earlier load's config; a load whose
config equals the one the model runs with changes nothing). A reload builds the new model first, then unloads the old
one as above, so for that moment requests to it are refused 404/503. One load or unload runs at a time.

What it trusts and what it refuses (docs/serving.md, "Security"): the repository's contents are the operator's and
are trusted (a ``.pt2`` is deserialized, which is as good as running it; a TorchScript file is code too), so nothing
outside the root is ever loaded. A model name is a plain name (:data:`NAME`: letters, digits, ``_``, ``-``, ``.``,
not starting with ``.``, at most 128 characters) and no name a route takes
(:data:`~opweave.serve.models.RESERVED_NAMES`) before it comes near a path; the program and config a name leads to
must resolve to files under the resolved root (a symbolic link leaving the root is refused unless
``allow_symlinks_outside_root``). With ``control="none"`` (Triton's ``--model-control-mode none``) the repository
API neither loads nor unloads: every model is loaded at start (:meth:`Repository.load_all`) and stays. A load's
config from a client (``parameters.config``, RFC 8259 JSON as a request's) may not raise ``max_batch_size`` above
the server's ``max_batch``, nor set the model's ``parameters`` (its checks) otherwise than the repository's
``config.pbtxt``, nor give a TorchScript model's input another data type or more values than the repository's
``config.pbtxt`` gives it (so it cannot loosen a check, nor raise the model's request limit past what the operator's
config and ``--max-batch`` allow). :attr:`Repository.on_load` is told of each model loaded.
Every refusal is one line that names the model, never a path outside the repository, and a load that fails
puts one line in the server's log; a directory that is no plain name (or no UTF-8) is left out of the index, with a
warning in the server's log.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

from opweave.errors import OpweaveError, UsageError, did_you_mean, first_line
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import Refused, release_memory
from opweave.serve.models import ServedModel, load, reserved
from opweave.serve.protocol import ProtocolError, loads, shown
from opweave.serve.repository.layout import (
    CONFIG,
    MAX_BATCH_SIZE,
    MAX_CONFIG_CHARS,
    MODEL_FILE,
    MODEL_FILES,
    NAME,
    allows_non_finite,
    declares_no_batching,
    named_outputs,
    program_in,
    settings_of,
    torchscript_inputs,
    version_dirs,
    versions_in,
    warmup_batches,
)

CONTROL_MODES = ("none", "explicit")

log = logging.getLogger(__name__)


class Repository:
    """The served models (:attr:`served`, the dict both front ends look names up in) and the directory more come from
    (``root``; None: only the models given at start). ``control``: ``"none"`` (the repository API neither loads nor
    unloads) or ``"explicit"`` (it does); ``allow_symlinks_outside_root``: follow links that leave the root."""

    def __init__(self, engine: Engine, served: dict[str, ServedModel], root: str | Path | None = None, *,
                 device: str = "cpu", max_batch: int = 8, unload_timeout_s: float = 120.0,
                 control: str = "none", allow_symlinks_outside_root: bool = False):
        if control not in CONTROL_MODES:
            raise UsageError(f"--model-control-mode must be one of {', '.join(CONTROL_MODES)}, got {control!r}"
                             f"{did_you_mean(control, CONTROL_MODES)}")
        self.engine, self.served = engine, served
        self.root = None if root is None else Path(root).resolve()
        if self.root is not None and not self.root.is_dir():
            raise UsageError(f"--model-repository {root}: no such directory")
        self.device, self.max_batch, self.unload_timeout_s = device, max_batch, unload_timeout_s
        self.allow_outside = allow_symlinks_outside_root
        self.status: dict[str, tuple[str, str]] = {name: ("READY", "") for name in served}
        # None: load and unload allowed; else why they are refused
        self.changes = None if control == "explicit" else (
            "the model repository is read-only: models are loaded at start (opweave serve --model-control-mode "
            "explicit lets the repository API load and unload)")
        self._changing = threading.Lock()
        self._skipped: set[str] = set()
        self._configs: dict[str, bytes] = {}  # the config each model of the repository was loaded with (_settings)
        self.on_load: list[Callable[[ServedModel], None]] = []  # told of each model once it serves

    # ---- what is there ----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Model directories of the repository (those with a version directory holding a program, or any file: a
        model opweave cannot serve is listed, and UNAVAILABLE once loaded); an entry whose name is no plain name, or
        that cannot be read, is left out (with a warning in the log, once)."""
        if self.root is None:
            return []
        out = []
        try:
            entries = list(self.root.iterdir())
        except OSError as exc:
            self._skip(".", f"the repository cannot be read ({exc.strerror})")
            return []
        for d in entries:
            if not NAME.fullmatch(d.name):
                self._skip(d.name, "not a plain model name (letters, digits, '_', '-', '.', not starting with '.', "
                                   "at most 128 characters)")
                continue
            try:
                if d.is_dir() and any(any(v.iterdir()) for v in version_dirs(d)):
                    out.append(d.name)
            except OSError as exc:
                self._skip(d.name, f"it cannot be read ({exc.strerror})")
        return sorted(out)

    def _skip(self, name: str, why: str) -> None:
        if name not in self._skipped:
            self._skipped.add(name)
            log.warning("model repository: skipping entry %s: %s", ascii(name), why)

    def index(self, ready: bool = False) -> list[dict]:
        """Triton's repository index: every model of the repository or served, its version, state (READY,
        UNAVAILABLE, LOADING, UNLOADING) and reason; ``ready``: only the READY ones."""
        out = []
        for name in sorted(set(self.names()) | set(self.served) | set(self.status)):
            state, reason = self.status.get(name, ("UNAVAILABLE", "not loaded"))
            model = self.served.get(name)
            version = model.version if model is not None else self._latest(name)
            if not ready or state == "READY":
                out.append({"name": name, "version": version, "state": state, "reason": reason})
        return out

    def _latest(self, name: str) -> str:
        try:
            versions = versions_in(self.root / name) if self.root is not None and NAME.fullmatch(name) and \
                (self.root / name).is_dir() else []
        except OSError:
            versions = []
        return str(max(versions)) if versions else ""

    def folder(self, name: str) -> Path:
        """``name``'s directory under the root; :class:`Refused` for a name that is no plain name."""
        if self.root is None:
            raise Refused("invalid", f"cannot load {shown(name)}: the server has no model repository (opweave serve "
                                     f"--model-repository DIR)")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise Refused("invalid", f"model name {shown(name)} is not a plain name (letters, digits, '_', '-', "
                                     f"'.', not starting with '.', at most 128 characters)")
        why = reserved(name)
        if why is not None:
            raise Refused("invalid", why)
        return self.root / name

    def _confined(self, path: Path, name: str) -> Path:
        """``path`` (under ``name``'s directory) if it resolves under the root; else :class:`Refused`."""
        root = self.root
        assert root is not None  # only a repository's models are confined to it
        if not self.allow_outside and not path.resolve().is_relative_to(root):
            raise Refused("invalid", f"model {name!r}: {path.relative_to(root)} is a link leading outside the "
                                     f"model repository (opweave serve --allow-symlinks-outside-root follows it)")
        return path

    def read_config(self, name: str, text: str | None = None, json_text: str | None = None):
        """``name``'s ModelConfig: from ``json_text`` (a load request's), ``text`` (protobuf text), or its
        ``config.pbtxt`` (an empty one if there is none)."""
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        config = model_config_pb2.ModelConfig()
        try:
            if json_text is not None:
                if len(json_text) > MAX_CONFIG_CHARS:
                    raise Refused("invalid", f"model {name!r}: parameters.config of {len(json_text)} characters "
                                             f"exceeds the limit of {MAX_CONFIG_CHARS}")
                json_format.ParseDict(loads(json_text), config)  # RFC 8259, checked as a request's JSON is
            else:
                path = self.folder(name) / CONFIG if self.root is not None else None
                if text is None and path is not None and path.is_file():
                    text = self._confined(path, name).read_bytes().decode("utf-8")
                if text is not None:
                    text_format.Parse(text, config)
        except UnicodeDecodeError as exc:
            raise Refused("invalid", f"model {name!r}: its {CONFIG} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise Refused("invalid", f"model {name!r}: its {CONFIG} cannot be read ({exc.strerror})") from None
        except (json_format.ParseError, text_format.ParseError, RecursionError, ProtocolError) as exc:
            raise Refused("invalid", f"model {name!r}: its config does not parse: {exc}") from None
        if config.name and config.name != name:
            raise Refused("invalid", f"model {name!r}: its config names it {shown(config.name)}")
        return config

    def locate(self, name: str, config) -> tuple[str, Path]:
        """The version to serve and its program."""
        folder = self.folder(name)
        try:
            versions = versions_in(folder) if folder.is_dir() else []
        except OSError as exc:
            raise Refused("invalid", f"model {name!r}: its directory cannot be read ({exc.strerror})") from None
        if not versions:
            try:
                held = sorted(f"{v.name}/{f.name}" for v in version_dirs(folder) for f in v.iterdir()) \
                    if folder.is_dir() else []
            except OSError:  # a version directory that cannot be listed holds nothing opweave can serve
                held = []
            if held:
                raise Refused("invalid", f"model {name!r}: no {' or '.join(MODEL_FILES)} in its version directories "
                                         f"(they hold {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): "
                                         f"opweave serves torch.export programs and TorchScript")
            raise Refused("not_found", f"model {name!r} is not in the repository (expected "
                                       f"{name}/<version>/{MODEL_FILE} or {MODEL_FILES[1]})")
        policy = config.version_policy.WhichOneof("policy_choice")
        if policy == "specific":
            listed = [v for v in versions if v in set(config.version_policy.specific.versions)]
            if not listed:
                raise Refused("not_found", f"model {name!r}: none of the versions "
                                           f"{list(config.version_policy.specific.versions)[:16]} is in the "
                                           f"repository")
            version = max(listed)
        elif policy == "all":
            raise Refused("invalid", f"model {name!r}: opweave serves one version of a model (version_policy all)")
        else:
            version = max(versions)
        program = program_in(folder / str(version))
        assert program is not None  # versions holds only those with a program
        return str(version), self._confined(program, name)

    # ---- changes ----------------------------------------------------------------------------------------------
    def load(self, name: str, config_json: str | None = None) -> ServedModel:
        """Load (or reload, if its version changed) ``name`` from the repository, for the repository API (refused
        with ``control="none"``); blocking (module docstring). :class:`Refused` says why not."""
        if self.root is not None:
            self._check_changes()
        return self._load(name, config_json)

    def _load(self, name: str, config_json: str | None = None) -> ServedModel:
        with self._changing:
            previous = self.status.get(name)
            try:
                return self._link(name, config_json)
            except Refused as exc:
                if name in self.served and previous is not None:
                    self.status[name] = previous
                elif previous is not None or self._entry(name):  # a model of the repository: the index says why
                    self.status[name] = ("UNAVAILABLE", str(exc))
                if exc.kind != "not_found":
                    log.warning("model repository: %s", exc)
                raise

    def _entry(self, name: str) -> bool:
        try:
            return self.root is not None and bool(NAME.fullmatch(name)) and (self.root / name).is_dir()
        except OSError:
            return False

    def _link(self, name: str, config_json: str | None) -> ServedModel:
        config = self.read_config(name, json_text=config_json)
        max_batch = self._max_batch(name, config, config_json is not None)
        allow_non_finite = allows_non_finite(name, config)
        version, path = self.locate(name, config)
        if config_json is not None:
            self._within_repository_config(name, config, scripted=path.suffix == ".pt")
        source = f"{name}/{version}/{path.name}"
        settings = settings_of(name, config)
        old = self.served.get(name)
        if old is not None and old.version == version and old.source == source and \
                self._configs.get(name) == settings:
            return old  # nothing changed: no reload, no moment without the model
        self.status[name] = ("LOADING", "")
        try:
            model = self._build(name, path, version, config, max_batch)
            model.source, model.allow_non_finite = source, allow_non_finite
            if old is not None:
                self._unload(name)
            self.engine.add_model(name, model.blocked, model.max_batch)
        except Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - a file that does not load is refused, whatever it raised
            if not isinstance(exc, OpweaveError):
                log.debug("model repository: model %r did not load", name, exc_info=True)
            why = str(exc) if isinstance(exc, OpweaveError) else first_line(exc)
            reason = self._hide(f"model {name!r} did not load: {why}")
        else:
            self.served[name] = model
            self._configs[name] = settings
            self.status[name] = ("READY", "")
            for told in self.on_load:
                told(model)
            return model
        raise Refused("invalid", reason)

    def _max_batch(self, name: str, config, from_client: bool) -> int:
        """The samples per instance ``config`` asks for (:mod:`~opweave.serve.repository.layout`), within bounds."""
        asked = config.max_batch_size
        bound = self.max_batch if from_client else MAX_BATCH_SIZE
        if not 0 <= asked <= bound:
            where = "parameters.config" if from_client else CONFIG
            raise Refused("invalid", f"model {name!r}: {where} max_batch_size {asked} is outside 0..{bound}"
                                     + (" (the server's --max-batch)" if from_client else ""))
        if asked > 0:
            return asked
        return 1 if declares_no_batching(config) else self.max_batch

    def _within_repository_config(self, name: str, config, scripted: bool) -> None:
        """A client's ``config`` changes nothing the repository's ``config.pbtxt`` decides for the client: the model's
        ``parameters`` (its checks: :data:`~opweave.serve.protocol.NON_FINITE_PARAMETER`) are the repository's
        config's, and for a TorchScript model (whose inputs its config describes) no input has another data type or
        more values than the repository's config gives it, nor is one there that it does not describe: else a
        300-byte load would let every client's NaN in, or set the size of the example the model is converted on and
        of every request it takes."""
        own = self.read_config(name)
        theirs = {k: v.string_value for k, v in config.parameters.items()}
        mine = {k: v.string_value for k, v in own.parameters.items()}
        changed = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
        if changed:
            raise Refused("invalid", f"model {name!r}: parameters.config sets parameters {shown(changed)} otherwise "
                                     f"than its {CONFIG}: a client's config cannot change a model's parameters (its "
                                     f"checks)")
        if not scripted:
            return
        inputs = {i.name: i for i in own.input}
        for tensor in config.input:
            values = math.prod(tensor.dims)
            mine_in = inputs.get(tensor.name)
            if mine_in is None or values > math.prod(mine_in.dims):
                allowed = f"{math.prod(mine_in.dims)} values" if mine_in is not None else "no shape for it"
                raise Refused("invalid", f"model {name!r}: parameters.config gives input {shown(tensor.name)} dims "
                                         f"{list(tensor.dims)[:8]} ({values} values), its {CONFIG} {allowed}: a "
                                         f"client's config cannot make a model's inputs larger")
            if tensor.data_type != mine_in.data_type:
                from tritonclient.grpc import model_config_pb2

                kinds = [model_config_pb2.DataType.Name(t) if t in model_config_pb2.DataType.values() else str(t)
                         for t in (tensor.data_type, mine_in.data_type)]
                raise Refused("invalid", f"model {name!r}: parameters.config gives input {shown(tensor.name)} "
                                         f"data_type {kinds[0]}, its {CONFIG} {kinds[1]}: a client's config cannot "
                                         f"change a model's data types")

    def _hide(self, text: str) -> str:
        """``text`` with the repository's own path left out (paths show relative to the root)."""
        return text if self.root is None else text.replace(str(self.root) + os.sep, "").replace(str(self.root), ".")

    def _build(self, name: str, path: Path, version: str, config, max_batch: int) -> ServedModel:
        """Capture, split and compile ``path`` (off every lock the engine holds)."""
        if path.suffix == ".pt":
            model = load(name, path=path, device=self.device, max_batch=max_batch,
                         example_inputs=torchscript_inputs(name, config))
            model.outputs = named_outputs(name, config, model.outputs)
        else:
            model = load(name, path=path, device=self.device, max_batch=max_batch)
        named = [i.name for i in config.input]
        if named and sorted(named) != sorted(s.name for s in model.inputs):
            raise Refused("invalid", f"model {name!r}: its config lists inputs {shown(named)}, the program takes "
                                     f"{[s.name for s in model.inputs]} (opweave does not rename inputs)")
        self.engine.executor.check_sizes(name, model.blocked)
        model.version = version
        self.engine.executor.warm_model(name, model.blocked, model.max_batch, warmup_batches(config))
        return model

    def unload(self, name: str) -> None:
        """Take ``name`` out of service, every request it accepted answered first; blocking (module docstring)."""
        self._check_changes()
        with self._changing:
            if name not in self.served:
                raise Refused("not_found", f"model {shown(name)} is not loaded")
            self._unload(name)
            self.status[name] = ("UNAVAILABLE", "unloaded")

    def _unload(self, name: str) -> None:
        self.status[name] = ("UNLOADING", "")
        self.served.pop(name, None)
        self._configs.pop(name, None)
        try:
            self.engine.remove_model(name, timeout_s=self.unload_timeout_s)
        except OpweaveError as exc:
            self.status[name] = ("UNLOADING", str(exc))
            raise Refused("error", str(exc)) from None
        release_memory()  # the model's graphs and compiled blocks hold cycles: give their memory back now

    def _check_changes(self) -> None:
        if self.changes is not None:
            raise Refused("invalid", self.changes)

    def load_all(self, strict: bool = False, say: Callable[[str], None] | None = None) -> list[str]:
        """Load every model of the repository (at start, whatever ``control`` says). A model that does not load is
        UNAVAILABLE with its reason in the index (and the log) while the others are served; ``strict``: raise
        :class:`~opweave.errors.UsageError` naming it instead (Triton's ``--exit-on-error``). ``say``: told which
        model loads, one line each (a progress bar)."""
        loaded = []
        todo = [name for name in self.names() if name not in self.served]
        for i, name in enumerate(todo, 1):
            if say is not None:
                say(f"loading {name} from the repository ({i}/{len(todo)}): capture, blocks, compile")
            try:
                loaded.append(self._load(name).name)
            except Refused as exc:  # _load said it in the log
                if strict:
                    raise UsageError(f"{exc} (without --strict the other models are served)") from None
        return loaded


__all__ = ["CONTROL_MODES", "Repository"]
