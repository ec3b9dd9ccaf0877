"""LaunchPlan: the lowered form every backend executes.

Per device an ordered list (issue order) of instructions:

* ``launch(op, stream)``     run ``op`` on ``stream`` after everything issued to that stream before;
* ``record(event, stream)``  mark the point in ``stream`` reached when all its earlier work is done;
* ``wait(stream, event)``    later work on ``stream`` starts only after the latest ``record`` of ``event`` issued
                             before this wait has completed;
* ``send(op, stream, peer)`` / ``recv(op, stream, peer)``  move ``op``'s output between devices; launches issued on
                             the receiving stream after the ``recv`` may read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("launch", "record", "wait", "send", "recv")


@dataclass(frozen=True)
class Instr:
    device: int
    kind: str
    stream: int
    op: str | None = None
    event: int | None = None
    peer: int | None = None

    @property
    def target(self) -> str:
        """The op a launch, send or recv names."""
        if self.op is None:
            raise ValueError(f"a {self.kind} names no op")
        return self.op

    @property
    def signal(self) -> int:
        """The event a record or wait names."""
        if self.event is None:
            raise ValueError(f"a {self.kind} names no event")
        return self.event

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class LaunchPlan:
    instrs: list[Instr] = field(default_factory=list)

    @property
    def devices(self) -> list[int]:
        return sorted({i.device for i in self.instrs})

    def on_device(self, device: int) -> list[Instr]:
        return [i for i in self.instrs if i.device == device]

    def streams(self, device: int) -> list[int]:
        return sorted({i.stream for i in self.instrs if i.device == device})

    @property
    def syncs(self) -> int:
        return sum(i.kind == "wait" for i in self.instrs)

    def to_list(self) -> list[dict[str, Any]]:
        return [i.to_dict() for i in self.instrs]
