"""The model repository (Triton's layout and repository extension): models that come and go while the server runs.

Layout (``opweave serve --model-repository DIR``)::

    DIR/<name>/config.pbtxt        optional: Triton's ModelConfig in protobuf text format
    DIR/<name>/<version>/model.pt2 a torch.export program (torch.export.save); version a positive integer

The version served is the highest present (Triton's default ``latest`` policy) or, with ``version_policy {
specific { versions: [...] } }``, the highest of those listed. Of ``config.pbtxt`` opweave reads ``name`` (if set,
the directory's), ``max_batch_size`` (samples per instance; 0 is Triton's "does not batch": 1; unset: the server's
``--max-batch``) and ``input`` (if listed, their names must be the program's inputs: opweave names inputs after the
program's arguments and does not rename them); the rest (platform, backend, instance groups, ...) is not opweave's
to follow and is ignored. A load request may carry the config instead (``parameters.config``: its JSON form, as
``tritonclient``'s ``load_model(name, config=...)`` sends it).

:meth:`Repository.load` and :meth:`Repository.unload` are slow (seconds) and blocking: the front ends call them on a
worker thread, never on their event loop, and they never hold the engine's lock while they capture or compile. A
load captures, splits and checks the program, compiles its blocks (``executor.warm_model``), and only then links it
into the engine (:meth:`Engine.add_model`, atomic); the other models are served all the while. An unload takes the
model out of :attr:`Repository.served` (new requests: 404), stops its queue (a request that raced the lookup: 503),
answers every request it had accepted, then the engine drops it between two steps (:meth:`Engine.remove_model`).
Loading a model that is served reloads it only if its version changed (the old one is unloaded as above first, so
for that moment requests to it are refused 404/503). One load or unload runs at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path

from opweave.errors import OpweaveError, UsageError
from opweave.serve.engine import Engine
from opweave.serve.frontend import Refused
from opweave.serve.models import ServedModel

CONFIG = "config.pbtxt"
MODEL_FILE = "model.pt2"


class Repository:
    """The served models (:attr:`served`, the dict both front ends look names up in) and the directory more come from
    (``root``; None: only the models given at start, which can be unloaded but not loaded again)."""

    def __init__(self, engine: Engine, served: dict[str, ServedModel], root: str | Path | None = None, *,
                 device: str = "cpu", max_batch: int = 8, unload_timeout_s: float = 120.0,
                 changes: str | None = None):
        self.engine, self.served = engine, served
        self.root = None if root is None else Path(root)
        if self.root is not None and not self.root.is_dir():
            raise UsageError(f"--model-repository {root}: no such directory")
        self.device, self.max_batch, self.unload_timeout_s = device, max_batch, unload_timeout_s
        self.status: dict[str, tuple[str, str]] = {name: ("READY", "") for name in served}
        self.changes = changes  # None: load and unload allowed; else why they are refused
        self._changing = threading.Lock()

    # ---- what is there ----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Model directories of the repository (those with at least one version holding a program)."""
        if self.root is None:
            return []
        return sorted(d.name for d in self.root.iterdir() if d.is_dir() and _versions(d))

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
        versions = _versions(self.root / name) if self.root is not None and (self.root / name).is_dir() else []
        return str(max(versions)) if versions else ""

    def read_config(self, name: str, text: str | None = None, json_text: str | None = None):
        """``name``'s ModelConfig: from ``json_text`` (a load request's), ``text`` (protobuf text), or its
        ``config.pbtxt`` (an empty one if there is none)."""
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        config = model_config_pb2.ModelConfig()
        try:
            if json_text is not None:
                json_format.Parse(json_text, config)
            else:
                path = self.root / name / CONFIG if self.root is not None else None
                if text is None and path is not None and path.is_file():
                    text = path.read_text()
                if text is not None:
                    text_format.Parse(text, config)
        except (json_format.ParseError, text_format.ParseError) as exc:
            raise Refused("invalid", f"model {name!r}: its config does not parse: {exc}") from None
        if config.name and config.name != name:
            raise Refused("invalid", f"model {name!r}: its config names it {config.name!r}")
        return config

    def locate(self, name: str, config) -> tuple[str, Path]:
        """The version to serve and its program."""
        if self.root is None:
            raise Refused("invalid", f"cannot load {name!r}: the server has no model repository (opweave serve "
                                     f"--model-repository DIR)")
        folder = self.root / name
        versions = _versions(folder) if folder.is_dir() else []
        if not versions:
            raise Refused("not_found", f"model {name!r} is not in the repository {self.root} (expected "
                                       f"{name}/<version>/{MODEL_FILE})")
        policy = config.version_policy.WhichOneof("policy_choice")
        if policy == "specific":
            listed = [v for v in versions if v in set(config.version_policy.specific.versions)]
            if not listed:
                raise Refused("not_found", f"model {name!r}: none of the versions "
                                           f"{list(config.version_policy.specific.versions)} is in {folder}")
            version = max(listed)
        elif policy == "all":
            raise Refused("invalid", f"model {name!r}: opweave serves one version of a model (version_policy all)")
        else:
            version = max(versions)
        return str(version), folder / str(version) / MODEL_FILE

    # ---- changes ----------------------------------------------------------------------------------------------
    def load(self, name: str, config_json: str | None = None) -> ServedModel:
        """Load (or reload, if its version changed) ``name`` from the repository; blocking (module docstring).
        :class:`Refused` says why not."""
        self._check_changes()
        with self._changing:
            config = self.read_config(name, json_text=config_json)
            version, path = self.locate(name, config)
            old = self.served.get(name)
            if old is not None and old.version == version and old.source == str(path) and config_json is None:
                return old
            previous = self.status.get(name)
            self.status[name] = ("LOADING", "")
            try:
                model = self._build(name, path, version, config)
                if old is not None:
                    self._unload(name)
                self.engine.add_model(name, model.blocked, model.max_batch)
            except Refused as exc:
                self.status[name] = previous if name in self.served else ("UNAVAILABLE", str(exc))
                raise
            except OpweaveError as exc:
                self.status[name] = previous if name in self.served else ("UNAVAILABLE", str(exc))
                raise Refused("invalid", f"model {name!r} did not load: {exc}") from None
            self.served[name] = model
            self.status[name] = ("READY", "")
            return model

    def _build(self, name: str, path: Path, version: str, config) -> ServedModel:
        """Capture, split and compile ``path`` (off every lock the engine holds)."""
        from opweave.serve.models import load

        if config.max_batch_size > 0:
            max_batch = config.max_batch_size
        else:
            max_batch = 1 if _declares_no_batching(config) else self.max_batch
        model = load(name, path=path, device=self.device, max_batch=max_batch)
        named = [i.name for i in config.input]
        if named and sorted(named) != sorted(s.name for s in model.inputs):
            raise Refused("invalid", f"model {name!r}: its config lists inputs {named}, the program takes "
                                     f"{[s.name for s in model.inputs]} (opweave does not rename inputs)")
        model.version = version
        self.engine.executor.warm_model(name, model.blocked, model.max_batch)
        return model

    def unload(self, name: str) -> None:
        """Take ``name`` out of service, every request it accepted answered first; blocking (module docstring)."""
        self._check_changes()
        with self._changing:
            if name not in self.served:
                raise Refused("not_found", f"model {name!r} is not loaded")
            self._unload(name)
            self.status[name] = ("UNAVAILABLE", "unloaded")

    def _unload(self, name: str) -> None:
        self.status[name] = ("UNLOADING", "")
        self.served.pop(name, None)
        try:
            self.engine.remove_model(name, timeout_s=self.unload_timeout_s)
        except OpweaveError as exc:
            self.status[name] = ("UNLOADING", str(exc))
            raise Refused("error", str(exc)) from None

    def _check_changes(self) -> None:
        if self.changes is not None:
            raise Refused("invalid", self.changes)

    def load_all(self) -> list[str]:
        """Load every model of the repository (at start: Triton's default model control)."""
        return [self.load(name).name for name in self.names() if name not in self.served]


def _versions(folder: Path) -> list[int]:
    return sorted(int(d.name) for d in folder.iterdir()
                  if d.is_dir() and d.name.isdigit() and int(d.name) > 0 and (d / MODEL_FILE).is_file())


def _declares_no_batching(config) -> bool:
    """A config file that exists and leaves ``max_batch_size`` 0 (Triton: the model does not batch) — told apart from
    no config by having any field set."""
    return config.ByteSize() > 0 and config.max_batch_size == 0


__all__ = ["CONFIG", "MODEL_FILE", "Repository"]
