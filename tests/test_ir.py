import json
import math

import pytest

from opweave import examples
from opweave.ir import Edge, GraphError, Op, OpGraph, chain


def graph_dict(ops, edges, **extra):
    return {"format": "opweave.graph/1", "name": "t", "ops": ops, "edges": edges, **extra}


def test_lios_fig3_structure():
    g = examples.load("lios-fig3")
    assert len(g) == 10 and len(g.edges) == 12
    assert g.total_work_ms() == 73.0
    assert g.critical_path_ms() == 38.0  # v1 v2 v6 v9 v10 = 3 + 5 + 15 + 13 + 2
    assert g.preds["v6"] == ["v2", "v3"] and g.succs["v1"] == ["v2", "v3", "v4", "v5"]
    assert g.reaches("v1", "v10") and not g.reaches("v10", "v1")
    assert g.independent("v2", "v7") and not g.independent("v4", "v7")


def test_topo_order_keeps_capture_order_when_it_is_topological():
    g = examples.load("lios-fig3")
    assert g.topo_order == g.ids
    shuffled = OpGraph([Op("b"), Op("a")], [Edge("a", "b")])
    assert shuffled.topo_order == ["a", "b"]


def test_json_round_trip(tmp_path):
    g = OpGraph([Op("x", name="conv", target="aten.convolution", flops=10.0, bytes=4.0, latency_ms=1.5,
                    utilization=0.5, resources={"threads": 256}),
                 Op("y", category="memory", shape=[1, 3], dtype="float32")],
                [Edge("x", "y", bytes=12.0, transfer_ms=0.2)], name="rt")
    path = tmp_path / "g.json"
    g.save(path)
    back = OpGraph.load(path)
    assert back.to_dict() == g.to_dict()
    assert back.ops == g.ops and back.edges == g.edges and back.name == "rt"


@pytest.mark.parametrize(
    "data, needle",
    [
        (graph_dict([{"id": "a"}, {"id": "a"}], []), "duplicate op id 'a'"),
        (graph_dict([{"id": "a"}], [{"src": "a", "dst": "zz"}]), "unknown op 'zz'"),
        (graph_dict([{"id": "a"}, {"id": "b"}], [{"src": "a", "dst": "b"}, {"src": "b", "dst": "a"}]), "cycle"),
        (graph_dict([{"id": "a", "latency_ms": -1}], []), "op 'a': latency_ms"),
        (graph_dict([{"id": "a", "flops": math.inf}], []), "op 'a': flops"),
        (graph_dict([{"id": "a"}, {"id": "b"}], [{"src": "a", "dst": "b", "transfer_ms": -0.5}]), "'a' -> 'b'"),
        ({"format": "opweave.graph/9", "ops": [], "edges": []}, "unknown format 'opweave.graph/9'"),
        (graph_dict([{"id": "a", "colour": "red"}], []), "op a: unknown field(s) colour"),
        (graph_dict([{"id": "a", "category": "io"}], []), "op 'a': category"),
        (graph_dict([{"id": "a"}], [{"src": "a", "dst": "a"}]), "self-loop on op 'a'"),
    ],
)
def test_malformed_graphs_are_rejected_naming_the_offender(data, needle):
    with pytest.raises(GraphError) as err:
        OpGraph.from_dict(json.loads(json.dumps(data, allow_nan=True)))
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_cycle_message_names_an_op_on_the_cycle():
    with pytest.raises(GraphError, match=r"cycle through op '(b|c)'"):
        OpGraph([Op("a"), Op("b"), Op("c")], [Edge("a", "b"), Edge("b", "c"), Edge("c", "b")])


def test_invalid_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.load(path)


def test_descendants_match_networkx():
    import networkx as nx

    g = examples.load("lios-fig3")
    ng = g.nx()
    for u in g.ids:
        assert {v for v in g.ids if g.reaches(u, v)} == nx.descendants(ng, u)


def test_chain():
    g = chain([1.0, 2.0, 3.0])
    assert g.critical_path_ms() == g.total_work_ms() == 6.0
    assert g.total_work_ms({"v0": 0.5, "v1": 0.5, "v2": 0.5}) == 1.5
