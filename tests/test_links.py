"""Links between devices (costs/links.py): presets, files, the least-squares fit, edge transfer times."""

from __future__ import annotations

import json

import pytest

from opweave.costs import from_graph
from opweave.costs.links import PRESETS, Link, fit, load, transfer_times, with_link
from opweave.errors import UsageError
from opweave.ir import examples
from opweave.ir.graph import Edge, Op, OpGraph
from opweave.schedulers import run


def test_presets_follow_their_datasheets():
    assert PRESETS["nvlink4"].bandwidth_gbs == 450.0  # 900 GB/s both directions
    assert PRESETS["pcie4"].bandwidth_gbs == pytest.approx(16 * 16 * 128 / 130 / 8, rel=1e-3)
    assert PRESETS["pcie5"].bandwidth_gbs == pytest.approx(32 * 16 * 128 / 130 / 8, rel=1e-3)
    link = PRESETS["pcie4"]
    assert link.transfer_ms(0) == link.latency_ms
    assert link.transfer_ms(31.5e9) == pytest.approx(link.latency_ms + 1000.0)


def test_fit_recovers_latency_and_bandwidth():
    truth = Link("truth", 0.05, 2.0)
    samples = [(b, truth.transfer_ms(b) * (1 + 0.01 * (-1) ** i)) for i, b in enumerate(2 ** k for k in range(6, 24))]
    got = fit(samples)
    assert got.latency_ms == pytest.approx(0.05, abs=0.01)
    assert got.bandwidth_gbs == pytest.approx(2.0, rel=0.02)
    with pytest.raises(UsageError, match="two message sizes"):
        fit([(64, 0.1), (64, 0.2)])
    with pytest.raises(UsageError, match="do not grow"):
        fit([(64, 0.2), (1 << 20, 0.1)])


def test_link_files_round_trip_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "l.json"
    fit([(64, 0.1), (1 << 20, 1.1)], name="m", source="test").save(path)
    link = load(path)
    assert link.name == "m" and link.bandwidth_gbs > 0 and len(link.samples) == 2
    assert load("NVLINK4") is PRESETS["nvlink4"]
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(UsageError, match="profile-links"):
        load(tmp_path / "bad.json")
    with pytest.raises(UsageError, match="unknown link 'warp'"):
        load("warp")
    with pytest.raises(UsageError, match="bandwidth > 0"):
        Link("zero", 0.0, 0.0)


def test_with_link_sets_every_edge_and_changes_hios():
    g = OpGraph([Op("a", latency_ms=1.0), Op("b", latency_ms=1.0), Op("c", latency_ms=1.0)],
                [Edge("a", "b", bytes=4e6), Edge("a", "c", bytes=4e6), Edge("b", "c", kind="war")])
    slow = Link("slow", 0.5, 1.0)
    times = transfer_times(g, slow)
    assert times[("a", "b")] == pytest.approx(0.5 + 4.0) and times[("b", "c")] == 0.5
    linked = with_link(g, slow)
    assert [e.transfer_ms for e in linked.edges] == [times[(e.src, e.dst)] for e in g.edges]
    assert g.edges[0].transfer_ms is None  # the original is left alone
    fig3 = examples.load("lios-fig3")
    fast = run("hios-lp", with_link(fig3, "nvlink4"), from_graph(with_link(fig3, "nvlink4")), devices=2)
    costly = run("hios-lp", with_link(fig3, Link("glacial", 50.0, 1.0)),
                 from_graph(with_link(fig3, Link("glacial", 50.0, 1.0))), devices=2)
    assert fast.devices_used == 2 and costly.devices_used == 1  # a transfer dearer than any op: one device
