"""A causal LM's decode step on opweave: the static KV cache captured as state written in place, ordered and proven
by the validator; greedy generation on the compiled step equal to transformers' own, on the CPU default and on CUDA
(the fake runtime where no GPU is present). Tiny configurations (2 layers, hidden size 64) keep each build a few
seconds; ``benchmarks/decode.py --check`` runs the models at batch 1 and 4 over 64 tokens."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

import opweave  # noqa: E402
from cuda_runtime import rt  # noqa: E402,F401 - the fixture
from opweave.capture import capture  # noqa: E402
from opweave.errors import PlanError, UsageError  # noqa: E402
from opweave.ir import OpGraph  # noqa: E402
from opweave.llm import DecodeStep, models, static_moe  # noqa: E402
from opweave.llm.decoding import decoder  # noqa: E402
from opweave.plan.lower import lower  # noqa: E402
from opweave.plan.validate import validate  # noqa: E402
from opweave.schedulers.schedule import Schedule  # noqa: E402


def prompt(rows: int, tokens: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def eager(model, ids: torch.Tensor, new: int):
    """transformers' greedy generation: the tokens and each step's scores."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences, list(out.scores)


def assert_same(expected, got) -> None:
    (tokens, scores), (ours, logits) = expected, got
    assert torch.equal(ours, tokens)
    assert len(logits) == len(scores)
    for want, have in zip(scores, logits, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def llama_step():
    """A tiny Llama's decode step (batch 2, 32 slots) and its capture at position 3."""
    step = DecodeStep(models.create("llama", tiny=True), 2, 32).eval()
    return step, capture(step, (prompt(2, 1), torch.tensor([3])))


def test_capture_writes_the_cache_in_place_where_the_step_says(llama_step):
    step, captured = llama_step
    writes = captured.state_writes()
    assert len(writes) == 4  # keys and values of 2 layers
    targets = {n.name: n.target for n in captured.gm.graph.nodes if n.op == "get_attr"}
    assert {targets[n] for names in writes.values() for n in names} == set(step.opweave_state)
    for op in writes:  # each write is the model's own in-place op, read after it by the attention
        assert captured.graph.op[op].target == "aten.index_copy_"
        assert captured.graph.succs[op]
    assert not any(o.target == "aten.copy_" for o in captured.graph.ops)  # no write-back of a whole buffer
    assert not any(getattr(step, n).any() for n in step.opweave_state)  # capture left the cache as it was
    with torch.no_grad():
        captured.run((prompt(2, 1, seed=5), torch.tensor([7])))
        got = step.keys_1.clone()
        step.reset()
        step(prompt(2, 1, seed=5), torch.tensor([7]))
    written = got.abs().sum(dim=(0, 1, 3)).nonzero().flatten().tolist()
    assert written == [7] and torch.equal(got, step.keys_1)
    step.reset()


def test_a_plan_that_leaves_a_cache_write_unordered_is_refused(llama_step):
    _, captured = llama_step
    graph = captured.graph
    writer = next(iter(captured.state_writes()))
    reader = graph.succs[writer][0]
    order = graph.topo_order
    schedule = Schedule("hand", order, {op: int(op == writer) for op in order})
    validate(graph, lower(graph, schedule), schedule)  # the write on its own stream, waited for
    dropped = OpGraph(graph.ops, [e for e in graph.edges if (e.src, e.dst) != (writer, reader)], graph.name)
    with pytest.raises(PlanError, match=f"edge '{writer}' -> '{reader}'"):
        validate(graph, lower(dropped, schedule), schedule)


def test_whole_graph_onnx_runtime_refuses_a_cache_it_cannot_write(llama_step):
    pytest.importorskip("onnxruntime")
    step, _ = llama_step
    with pytest.raises(UsageError, match="cannot write the model's state in place"):
        opweave.compile(step, (prompt(2, 1), torch.tensor([3])), device="cpu", graph="onnxruntime")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_static_experts_equal_the_experts_loop(name):
    model = models.create(name, tiny=True)
    experts = [type(m) for m in model.modules()]
    routed = static_moe(model)
    assert [type(m) for m in model.modules()] == experts  # the model given is left as it is
    assert {id(p) for p in routed.parameters()} == {id(p) for p in model.parameters()}
    with torch.no_grad():
        want = model(prompt(3), use_cache=False).logits
        got = routed(prompt(3), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_generate_on_the_cpu_default_equals_transformers():
    model = models.create("mixtral", tiny=True)
    ids = prompt(4)
    expected = eager(model, ids, 64)
    assert_same(expected, opweave.generate(model, ids, 64, device="cpu", return_logits=True))
    run = decoder(model, 4, 128, device="cpu")
    assert run.compiled.choice is not None  # the CPU default's race chose
    assert len(run.compiled.signatures) == 2  # the step and the prompt: two signatures of one compiled model
    assert torch.equal(opweave.generate(model, ids, 64, device="cpu"), expected[0])  # compiled once, kept
    assert decoder(model, 4, 128, device="cpu") is run


def test_onnx_runtime_segments_leave_the_cache_writes_to_pytorch():
    pytest.importorskip("onnxruntime")
    model = models.create("gptj", tiny=True)
    ids = prompt(1)
    got = opweave.generate(model, ids, 12, device="cpu", scheduler="sequential", compiler="onnxruntime",
                           return_logits=True)
    assert_same(eager(model, ids, 12), got)
    fused = decoder(model, 1, 64, device="cpu", scheduler="sequential", compiler="onnxruntime").compiled.fused
    assert fused.stats["compiles"] >= 2 and fused.stats["fallbacks"] == 0  # ONNX Runtime around the writes
    assert fused.stats["segments"] == fused.stats["compiles"] + 4  # and each write a segment of its own


def test_generate_on_cuda_streams_equals_transformers(rt):  # noqa: F811 - the fixture
    model = models.create("qwen2_moe", tiny=True).to(rt.device)
    ids = prompt(2).to(rt.device)
    expected = eager(model, ids, 8)
    got = opweave.generate(model, ids, 8, runtime=rt, return_logits=True)
    rt.synchronize()
    assert_same(expected, got)
    run = decoder(model, 2, 64, runtime=rt)
    assert run.compiled.schedule.streams_used > 1  # experts, shared expert and router side by side
    assert run.compiled.choice["reason"]  # the calibrated simulator's pick
    validate(run.compiled.graph, run.compiled.plan, run.compiled.schedule)


def test_generate_ends_rows_as_transformers_does():
    model = models.create("llama", tiny=True)
    ids = prompt(2)
    free = eager(model, ids, 6)[0]
    model.generation_config.eos_token_id = int(free[0, 18])  # row 0 ends at its third token
    model.generation_config.pad_token_id = 0
    expected = eager(model, ids, 6)
    got = opweave.generate(model, ids, 6, device="cpu", scheduler="sequential", return_logits=True)
    assert_same(expected, got)
    assert got[0][0, 19:].eq(0).all()
    kept = weakref.ref(model)  # the decoder kept for the model goes with it
    del model
    gc.collect()
    assert kept() is None


def test_a_cache_longer_than_a_sliding_window_is_refused():
    import transformers

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    model = transformers.MistralForCausalLM(config).eval()
    DecodeStep(model, 1, 16)  # within the window
    with pytest.raises(UsageError, match="sliding window of 16 tokens; a cache of 32 slots"):
        DecodeStep(model, 1, 32)
