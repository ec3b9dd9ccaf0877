"""Distributed backend: a multi-device launch plan (HIOS) run by one process per device, on torch.distributed.

HIOS (Kundu & Shu, 2023) runs each GPU's subgraph in its own MPI process and moves tensors between GPUs with
CUDA-aware MPI (§VI-A); it suggests NCCL would hide more of the transfer (§VI-E). Here each device of a
:class:`~opweave.plan.LaunchPlan` is a *rank*, a process of a ``torch.distributed`` process group (gloo for CPU
ranks, NCCL for GPUs), and a ``send``/``recv`` pair of the plan is a point-to-point transfer:

* :mod:`.split` cuts the captured model and the plan into one part per rank (its lanes, the messages it sends and
  receives, its share of the parameters, the inputs it reads, the outputs it returns);
* :mod:`.rank` runs a part: worker threads per lane on a CPU, streams per lane on a GPU;
* :mod:`.launch` starts and supervises the rank processes (:class:`DistributedBackend`, ``opweave.compile(...,
  devices=M)``); :mod:`.torchrun` runs the same parts under ``torchrun``; :mod:`.wire` is what travels.

**Memory.** Each rank materializes only the parameters and buffers of its own ops: its GraphModule is built from
a copy of the fx graph and a target map in which modules and tensors of other ranks' ops are replaced by
stand-ins holding no memory (a parameter-less module that refuses to run, ``meta`` tensors). Across the ranks the
parameter bytes add up to the model's (a parameter shared by ops of two ranks is held by both). Model inputs go
only to the ranks whose ops read them; the caller gets the outputs.

**Messages and their order.** Every ``send`` instruction of the plan is one message, numbered by its position in
the plan's instruction list; its ``recv`` s on the receiving rank are the instructions that pair with it (the latest
earlier send of the op between the two devices, :meth:`opweave.plan.semantics.PlanInterpreter.pair`). Shapes and dtypes
of what a message carries come from capture (ShapeProp), so receive buffers are allocated without a handshake.
Every rank posts the transfers it takes part in **in increasing message number**, both endpoints of a message
alike: the sender posts its ``isend`` as soon as the op's lane has produced the value (CPU: the lane raised the
send's signal; CUDA: at the send's place in the issue order, under the lane's stream), the receiver posts its
``irecv`` at the same place of its own walk, before anything that waits for it. Adjacent transfers go out as one
``batch_isend_irecv``.

**Why this cannot deadlock.** Give every instruction of the plan its position ``i`` in the list, and a message the
position of its send. (1) Everything an instruction waits for has a smaller position: the previous instruction of
its lane, the ``record`` of a ``wait`` and the ``send`` of a ``recv`` (the plan lists every source before its
sinks: the validator and the pairing require it). (2) A rank posts message ``k`` after the messages it shares
with smaller numbers and, when it is the sender, after the instructions of its lane up to ``k``'s send: only
smaller positions again. (3) A transfer completes once both endpoints have posted it: NCCL matches the
point-to-point operations between two ranks in the order they are posted, and both endpoints post the messages
they share in the same (increasing) order, so the j-th operation of one side meets the j-th of the other and it is
the same message (gloo also matches by tag, the message number). So every wait in the system points to a strictly
smaller position, the waits-for relation is acyclic, and by induction on the position every instruction and every
transfer completes. Receive-before-use needs no argument of its own: a lane reads a message's values only after
its ``recv`` step returned, which waits for the transfer.

**Failures.** A rank that raises reports the error and exits; one that dies is seen through its process sentinel;
a transfer whose peer is gone fails (or times out after the process group's timeout). The caller then stops every
rank and raises one :class:`~opweave.errors.RankError` naming the rank and the cause (:mod:`.launch`). A rank
also exits as soon as its caller goes away (a lifeline pipe), so no rank outlives the process that started it.
"""

from opweave.backends.distributed.launch import DistributedBackend, Ranks, check_devices, profile_link
from opweave.backends.distributed.rank import RankRuntime, held_bytes
from opweave.backends.distributed.split import Message, RankPart, split

__all__ = ["DistributedBackend", "Message", "RankPart", "RankRuntime", "Ranks", "check_devices", "held_bytes",
           "profile_link", "split"]
