"""A served model whose sequence length varies between requests: exported with the length free (``opweave export
--free-dim``), reported as -1 within its range, requests of one length stacked only with their own, each length run
by the blocks' sessions (checked against the block beside the first call of a length, never built per length)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from torch import nn

from opweave.errors import UsageError
from opweave.serve.assemble import make_engine, serving_options
from opweave.serve.models import load
from opweave.serve.protocol import HEADER, ProtocolError, decode_request, encode_tensor, request_limit
from opweave.serve.repository import Repository
from opweave.serve.repository.export import export, parse_free_dims
from opweave.testing.serving import BackgroundServer

pytest.importorskip("onnxruntime")

LONGEST = 16


class Attend(nn.Module):
    """Token ids and a mask of one length: embedding, self-attention over the length, a projection."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 16)
        self.project = nn.Linear(16, 8)

    def forward(self, ids, mask):
        x = self.embed(ids) * mask.unsqueeze(-1)
        scores = torch.softmax(x @ x.transpose(1, 2) / 4.0, dim=-1)
        return self.project(torch.relu(scores @ x))


def inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (batch, length), generator=g), torch.rand(batch, length, generator=g)


def eager(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, mask)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lengths")
    model = Attend().eval()
    served = export(model, inputs(1, 8), root, "attend", max_batch=4,
                    free=parse_free_dims([f"ids:1,mask:1=2-{LONGEST}"]))
    return root, model, served


def test_export_writes_the_free_dimension_as_minus_one_and_the_server_reports_its_range(exported):
    root, _, served = exported
    config = (root / "attend" / "config.pbtxt").read_text()
    assert config.count("dims: -1") == 3  # ids, mask and the output's length
    assert [s.shape for s in served.inputs] == [(-1, -1), (-1, -1)]
    assert served.outputs[0].shape == (-1, -1, 8)
    assert served.inputs[0].ranges[0][:3] == (1, 2, LONGEST)
    assert served.inputs[0].ranges[0][3] == served.inputs[1].ranges[0][3]  # one length for both
    assert served.blocked.sizes_vary
    # the request bound counts the longest length, not the example's
    assert request_limit(served, per_value=1, batch=1) == request_limit(served, per_value=0) + 2 * LONGEST


@pytest.mark.parametrize("items, why", [(["ids:1"], "must be"), (["ids=2-8"], "must be"), (["ids:1=8-2"], "range"),
                                        (["ids:x=2-8"], "must be")])
def test_a_malformed_free_dimension_is_refused_saying_the_form(items, why):
    with pytest.raises(UsageError, match=why):
        parse_free_dims(items)


def test_a_free_dimension_of_an_input_the_model_lacks_is_refused_with_its_inputs(tmp_path):
    with pytest.raises(UsageError, match="no input 'idz'.*did you mean 'ids'"):
        export(Attend().eval(), inputs(1, 8), tmp_path, "attend", free=parse_free_dims(["idz:1=2-8"]))


def request(ids: torch.Tensor, mask: torch.Tensor) -> dict:
    return {"inputs": [{"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.flatten().tolist()},
                       {"name": "mask", "shape": list(mask.shape), "datatype": "FP32",
                        "data": mask.flatten().tolist()}]}


@pytest.mark.parametrize("ids_len, mask_len, why", [(1, 1, r"dimension 1 is 1, outside 2\.\.16"),
                                                    (17, 17, r"outside 2\.\.16"),
                                                    (5, 6, "'mask': dimension 1 is 6, input 'ids'.* takes them equal")])
def test_a_length_outside_the_range_or_two_unequal_lengths_are_refused_before_the_model(exported, ids_len, mask_len,
                                                                                      why):
    _, _, served = exported
    ids, _ = inputs(1, ids_len)
    _, mask = inputs(1, mask_len)
    with pytest.raises(ProtocolError, match=why):
        decode_request(served, request(ids, mask))


def test_every_length_in_range_is_accepted(exported):
    _, _, served = exported
    for length in (2, 9, LONGEST):
        decoded = decode_request(served, request(*inputs(3, length)))
        assert decoded.batch == 3 and decoded.inputs[0].shape == (3, length)


@pytest.mark.parametrize("policy", ["static", "batch", "heuristic"])
def test_requests_of_several_lengths_sent_at_once_are_answered_each_equal_to_eager_and_none_built(exported, policy):
    """Requests of four lengths and two batch sizes queued before the engine starts: stacked (the policies that
    stack), they would be joined by torch.cat across lengths and answered an error; each length kept apart, each
    answer equals the model run eagerly, and no block is built for a length (its session takes every one)."""
    root, model, _ = exported
    served = load("attend", path=root / "attend" / "1" / "model.pt2", max_batch=4)
    engine = make_engine({"attend": served}, device="cpu", max_batch=4, policy=policy)
    sent = [(inputs(batch, length, seed=10 * length + batch), batch)
            for batch in (1, 3) for length in (3, 8, 11, LONGEST)]
    done = threading.Semaphore(0)
    asked = [engine.submit("attend", list(x), batch=batch, on_done=lambda r: done.release()) for x, batch in sent]
    engine.start()
    try:
        for _ in asked:
            assert done.acquire(timeout=120)
    finally:
        engine.stop()
    for request_, ((ids, mask), _) in zip(asked, sent, strict=True):
        assert request_.status == "done", request_.error
        torch.testing.assert_close(request_.output, eager(model, ids, mask), rtol=1e-4, atol=1e-5)
    executor = engine.executor
    for served_block in executor._blocks.values():
        for batched in served_block.compiled.values():
            assert batched.compiled.variants.stats["builds"] == 0


def test_the_sessions_are_checked_at_another_length_before_the_model_serves_so_a_new_length_runs_on_them(exported):
    """Loading the model checks each block's session at another length (its answer held against the block's), so a
    request of a length never seen runs on the sessions directly: no check at request time, nothing built."""
    root, model, _ = exported
    served = load("attend", path=root / "attend" / "1" / "model.pt2", max_batch=4)
    assert served.blocked.other_sizes[0].shape == (1, 7)  # exported at 8: one shorter
    engine = make_engine({"attend": served}, device="cpu", max_batch=4)
    variants = [engine.executor.block("attend", i).compiled.variants for i in range(len(served.blocked.blocks))]
    assert all(v.stats["checks"] == 1 for v in variants)
    ids, mask = inputs(2, 13, seed=5)
    out = engine.executor.block("attend", 0)(*served.blocked.flat_inputs((ids, mask)))
    torch.testing.assert_close(out, served.blocked.modules[0](ids, mask))
    assert all(v.stats["checks"] == 1 and v.stats["builds"] == 0 for v in variants)
    assert variants[0].stats["resized"] >= 2  # the load's length and this one, on the session
    engine.stop()


def test_a_new_length_is_answered_by_the_blocks_themselves_while_the_sessions_check_is_held_back(exported, held):
    """A length met before the load's check is done (held back here) is answered at once, by each block run eagerly,
    while the session's answer waits to be checked; once checked, lengths run on the sessions."""
    root, model, _ = exported
    served = load("attend", path=root / "attend" / "1" / "model.pt2", max_batch=4)
    engine = make_engine({"attend": served}, device="cpu", max_batch=4)
    ids, mask = inputs(2, 13, seed=5)
    block = engine.executor.block("attend", 0)
    before = block.compiled.variants.stats["checks"]
    out = engine.executor.block("attend", 0)(*served.blocked.flat_inputs((ids, mask)))
    torch.testing.assert_close(out, served.blocked.modules[0](ids, mask))
    assert block.compiled.variants.stats["checks"] == before  # held back: nothing checked yet
    held.run()
    assert block.compiled.variants.stats["checks"] == before + 1
    assert block.compiled.variants.stats["builds"] == 0
    engine.stop()


def test_a_server_that_would_build_every_length_refuses_the_model_at_load(exported):
    root, _, _ = exported
    served = load("attend", path=root / "attend" / "1" / "model.pt2", max_batch=4)
    with pytest.raises(UsageError, match="sizes that vary between requests.*export it with fixed sizes"):
        make_engine({"attend": served}, device="cpu", options=serving_options("cpu", compiler="none"), max_batch=4,
                    warm=False)


def test_http_serves_each_length_equal_to_eager_and_refuses_one_out_of_range(exported):
    root, model, _ = exported
    engine = make_engine({}, device="cpu", max_batch=4, warm=False)
    repository = Repository(engine, {}, root=root, max_batch=4, control="explicit")
    repository.load("attend")
    with BackgroundServer(engine, repository.served, repository=repository) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        meta = client.get("/v2/models/attend").json()
        assert meta["inputs"][0]["shape"] == [-1, -1]
        for length in (4, 8, 15):
            ids, mask = inputs(2, length, seed=length)
            head = json.dumps({"inputs": [
                {"name": "ids", "shape": [2, length], "datatype": "INT64",
                 "parameters": {"binary_data_size": ids.numel() * 8}},
                {"name": "mask", "shape": [2, length], "datatype": "FP32",
                 "parameters": {"binary_data_size": mask.numel() * 4}}],
                "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}).encode()
            response = client.post("/v2/models/attend/infer", content=head + encode_tensor(ids) + encode_tensor(mask),
                                   headers={HEADER: str(len(head))})
            assert response.status_code == 200, response.text
            size = int(response.headers[HEADER])
            shape = json.loads(response.content[:size])["outputs"][0]["shape"]
            assert shape == [2, length, 8]
            out = torch.frombuffer(bytearray(response.content[size:]), dtype=torch.float32).reshape(shape)
            torch.testing.assert_close(out, eager(model, ids, mask), rtol=1e-4, atol=1e-5)
        too_long = client.post("/v2/models/attend/infer", json=request(*inputs(1, LONGEST + 1)))
        assert too_long.status_code == 400 and "outside 2..16" in too_long.text
