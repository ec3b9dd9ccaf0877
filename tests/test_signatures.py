"""A compiled model called with inputs of another shape (opweave.pipeline.signatures): built for them through the
pipeline with the same options, on the CPU and on the fake CUDA runtime, under every scheduler; within
``cache_size``; refused with ``dynamic=False``; built once when two threads ask for it at once; the same through
``torch.compile(backend="opweave")`` and from a ``.pt2`` exported with a dynamic batch."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import opweave
import opweave.dynamo
from opweave import schedulers, zoo
from opweave.errors import CaptureError, UsageError
from opweave.outputs import compare
from opweave.testing.fakecuda import FakeCuda

NEW = [(2, 3, 64, 64), (3, 3, 64, 64), (8, 3, 64, 64), (1, 3, 160, 160)]


def squeezenet():
    model, (x,) = zoo.create("squeezenet", image_size=64)
    return model.eval(), x


def check(model, fast, shape, runtime=None, seed: int = 0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = fast(x)
        if runtime is not None:
            runtime.synchronize()
        result = compare(model(x), got)
    assert result.ok, (shape, result.reason)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("scheduler", schedulers.names())
def test_squeezenet_compiled_at_batch_1_equals_eager_at_other_batches_and_sizes(scheduler, device):
    model, x = squeezenet()
    runtime = FakeCuda(seed=3) if device == "cuda" else None
    extra = {"runtime": runtime} if runtime is not None else {}
    streams = 1 if scheduler == "sequential" else 3
    fast = opweave.compile(model, (x,), device=device, scheduler=scheduler, streams=streams, **extra)
    for shape in NEW:
        check(model, fast, shape, runtime)
    check(model, fast, tuple(x.shape), runtime)  # the example's own signature still runs its own build
    assert [tuple(key[1][0]) for key in fast.signatures] == [tuple(x.shape), *NEW]
    assert fast.variants.stats["builds"] == len(NEW)
    assert all(v.schedule.scheduler == scheduler for v in fast.variants._built.values())


def test_a_bert_encoder_compiled_at_32_tokens_equals_eager_at_17_and_64():
    model, (ids,) = zoo.create("bert_base", num_layers=2, seq_len=32)
    model.eval()
    fast = opweave.compile(model, (ids,), scheduler="lios")
    for length in (17, 64):
        other = torch.randint(0, model.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            result = compare(model(other), fast(other))
        assert result.ok, (length, result.reason)


def test_past_the_bound_the_least_recently_used_is_dropped_and_built_again(caplog):
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios", cache_size=1)
    with caplog.at_level(logging.INFO, logger="opweave.pipeline.signatures"):
        check(model, fast, NEW[0])
        with pytest.warns(UserWarning, match="more than cache_size=1 input signatures"):
            check(model, fast, NEW[1])  # drops NEW[0]
        check(model, fast, NEW[0])  # built again
        check(model, fast, tuple(x.shape))  # the example's is never dropped
    assert fast.variants.stats == {"builds": 3, "evictions": 2}
    assert [tuple(key[1][0]) for key in fast.signatures] == [tuple(x.shape), NEW[0]]
    assert sum("building for a new input signature" in r.message for r in caplog.records) == 3


def test_dynamic_false_refuses_a_new_signature_naming_the_one_compiled():
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios", dynamic=False)
    with pytest.raises(UsageError, match=r"\(2, 3, 64, 64\) float32 differ from those it was compiled for "
                                         r"\(\(1, 3, 64, 64\) float32\)"):
        fast(torch.randn(2, 3, 64, 64))
    check(model, fast, tuple(x.shape))


def test_two_threads_asking_for_a_new_signature_at_once_build_it_once():
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios")
    real, started, release = fast.variants._build, threading.Event(), threading.Event()

    def slow_build(args):
        started.set()
        assert release.wait(60)
        return real(args)

    fast.variants._build = slow_build
    errors: list[BaseException] = []

    def call(seed: int) -> None:
        try:
            check(model, fast, NEW[0], seed=seed)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    first = threading.Thread(target=call, args=(1,))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=call, args=(2,))
    second.start()
    second.join(0.5)  # it waits for the build under way
    release.set()
    first.join(120)
    second.join(120)
    assert not errors and not first.is_alive() and not second.is_alive()
    assert fast.variants.stats["builds"] == 1


def test_the_torch_compile_backend_compiles_a_graph_with_symbolic_sizes_per_signature():
    """After a size changed once, dynamo hands over a graph with a symbolic batch; it ran eagerly, with a warning."""
    model, x = squeezenet()
    torch._dynamo.reset()
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios"})
    for batch in (1, 2, 3, 8):
        check(model, fast, (batch, 3, 64, 64))
    last = opweave.dynamo.last_compiled()
    assert last is not None and last.variants.stats["builds"] == 2  # built at batch 2, then 3 and 8
    torch._dynamo.reset()


def test_a_program_exported_with_a_dynamic_batch_runs_batches_1_to_8(tmp_path):
    model, x = squeezenet()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(model, (torch.randn(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    path = tmp_path / "squeezenet.pt2"
    torch.export.save(program, path)
    fast = opweave.compile(str(path), (torch.randn(1, 3, 64, 64),), scheduler="lios")
    for size in range(1, 9):
        check(model, fast, (size, 3, 64, 64), seed=size)
    with pytest.raises(CaptureError, match=r"Guard failed: x.size\(\)\[0\] <= 8"):  # beyond the program's range
        fast(torch.randn(9, 3, 64, 64))


def test_inputs_of_the_examples_shapes_on_another_device_are_its_signature_for_the_backend_to_move():
    """A model compiled for CUDA from CPU example inputs and called with CUDA tensors of the same shapes (or the
    reverse) runs on the backend built for the example, which moves inputs to its device: on an H200 such a call
    was taken for a new signature and captured again, running the CPU model on the GPU inputs. Here "meta" stands
    for the other device. A new shape is built once whatever device its inputs come on."""
    from opweave.pipeline.signatures import Signatures, key_of

    built = []
    example = (torch.randn(4, 8),)
    variants = Signatures("m", key_of(example), lambda args: built.append(args) or len(built), bound=2)
    assert variants.for_inputs((torch.empty(4, 8, device="meta"),)) is None and not built
    assert variants.for_inputs((torch.empty(2, 8, device="meta"),)) == 1
    assert variants.for_inputs((torch.randn(2, 8),)) == 1 and len(built) == 1
    assert variants.for_inputs((torch.randn(4, 8, dtype=torch.float64),)) == 2  # another dtype is another one


def test_a_new_signature_is_captured_on_the_devices_of_the_example():
    """The inputs of a new signature are moved where the example's were before the model is captured for them
    (where its parameters are); the built model moves each call's inputs itself."""
    from opweave.api import on_devices_of

    example = (torch.empty(4, 8, device="meta"), 3)
    moved = on_devices_of((torch.randn(2, 8), 5), example)
    assert moved[0].device.type == "meta" and tuple(moved[0].shape) == (2, 8) and moved[1] == 5
    assert on_devices_of((torch.randn(2, 8),), example)[0].device.type == "cpu"  # another structure: left alone


def test_every_signature_shares_one_folded_copy_of_the_weights():
    """Coarsening folds each BatchNorm into a copy of its convolution; every new signature, captured again, made its
    own copy (a compiled model that had met four input shapes held four copies of its folded weights). One copy now
    serves them all, made again only when the model's weights change."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU()).eval()
    fast = opweave.compile(model, (torch.randn(1, 3, 8, 8),), device="cpu", scheduler="sequential")
    for batch in (2, 3):
        check(model, fast, (batch, 3, 8, 8))
    builds = [fast, *fast.variants._built.values()]
    weights = {b.captured.gm.get_submodule("0").weight.data_ptr() for b in builds}
    assert len(builds) == 3 and len(weights) == 1
    assert model[0].weight.data_ptr() not in weights  # folded: a copy, the model's own weights left as they are
    with torch.no_grad():
        model[1].running_var.mul_(4)  # the model changed in place: a new signature folds it again
    check(model, fast, (4, 3, 8, 8))
    newest = list(fast.variants._built.values())[-1].captured.gm.get_submodule("0").weight.data_ptr()
    assert newest not in weights


def test_one_onnx_runtime_session_with_a_free_batch_takes_every_batch():
    """``dynamic=True`` where the whole model is one ONNX Runtime session: exported with its batch dimension free,
    checked at another batch, and then no other batch size is built (a server's blocks are built this way); a model
    that bakes its batch in fails the check and is built per batch as with dynamic unset."""
    pytest.importorskip("onnxruntime")

    class Baked(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x).reshape(2, -1).sum(1)

    torch.manual_seed(0)
    free = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    options = {"scheduler": "sequential", "streams": 1, "compiler": "onnxruntime", "dynamic": True}
    with opweave.compile(free, (torch.randn(2, 8),), **options) as fast, torch.no_grad():
        assert fast.any_batch
        for n in (1, 3, 7):
            x = torch.randn(n, 8)
            assert compare(free(x), fast(x), tolerance=1e-4).ok
        assert len(fast.signatures) == 1 and fast.variants.stats["builds"] == 0
    with opweave.compile(Baked(), (torch.randn(2, 5),), **options) as fast, torch.no_grad():
        assert not fast.any_batch
        x = torch.randn(4, 5)
        assert compare(Baked()(x[:2]), fast(x[:2])).ok and len(fast.signatures) == 1
