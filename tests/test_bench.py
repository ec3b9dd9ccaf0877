"""How ``opweave bench`` times and reads its modes (opweave.evaluate.bench): interleaved rounds, the spread of each
mode, the rule that calls a speed-up within the spread, and the other work on the machine. No test here times
anything: the functions timed are counters, the clock and the machine's CPU counters are stand-ins."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opweave.errors import UsageError
from opweave.evaluate import bench


def test_modes_alternate_in_rounds_each_starting_one_mode_further():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench.interleaved_times_ms(fns, runs=5, warmup=1, rounds=3)
    assert {name: len(t) for name, t in times.items()} == {"a": 5, "b": 5, "c": 5}
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    # 5 runs in 3 rounds: 2, 2 and 1 calls in a row per mode; round k starts at mode k
    assert timed == ["a", "a", "b", "b", "c", "c"] + ["b", "b", "c", "c", "a", "a"] + ["c", "a", "b"]


def test_each_modes_share_of_a_round_follows_untimed_calls_of_its_own_for_a_time(four_ms_calls):
    """Pools another engine left spinning spin for a time: with ``settle_ms`` a mode's share follows its own untimed
    calls until that long has passed (each call 4 ms on a scripted clock: three calls reach 10 ms), then ``settle``
    more."""
    fns, calls = four_ms_calls
    times = bench.interleaved_times_ms(fns, runs=1, warmup=0, rounds=1, settle=1, settle_ms=10.0)
    assert calls == ["a"] * 5 + ["b"] * 5 and all(len(t) == 1 for t in times.values())  # 3 + 1 untimed, 1 timed


def test_fewer_runs_than_rounds_make_one_round_per_run():
    calls: list[str] = []
    times = bench.interleaved_times_ms({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, runs=2,
                                       warmup=0)
    assert calls == ["x", "y", "y", "x"] and all(len(t) == 2 for t in times.values())
    with pytest.raises(UsageError, match="runs must be at least 1"):
        bench.interleaved_times_ms({"x": lambda: None}, runs=0, warmup=0)


def test_the_spread_is_p10_to_p90_as_a_share_of_the_median():
    s = bench.summarize([float(v) for v in range(1, 12)])  # 1..11 ms
    assert (s["median_ms"], s["p10_ms"], s["p90_ms"]) == (6.0, 2.0, 10.0)
    assert s["spread_pct"] == pytest.approx(100 * 8 / 6)
    one = bench.summarize([4.0])
    assert one == {"median_ms": 4.0, "p10_ms": 4.0, "p90_ms": 4.0, "spread_pct": 0.0}


def test_a_ratio_within_the_spread_is_flagged_and_a_clear_one_is_not():
    eager = bench.summarize([10, 10.5, 11, 11.5, 12, 12.5, 13, 13.5, 14, 14.5, 15])
    noisy = bench.summarize([9, 9.5, 10, 10.5, 11, 11.5, 12, 12.5, 13, 13.5, 14])  # 1.09x, but the ranges overlap
    clear = bench.summarize([5, 5.1, 5.2, 5.3, 5.4, 5.5, 5.6, 5.7, 5.8, 5.9, 6.0])  # 2.3x, well apart
    within = bench.versus(eager, noisy)
    assert within["speedup"] == pytest.approx(12.5 / 11.5) and within["within_spread"]
    apart = bench.versus(eager, clear)
    assert apart["speedup"] == pytest.approx(12.5 / 5.5) and not apart["within_spread"]
    slower = bench.versus(clear, eager)  # a clear slow-down is as clear
    assert slower["speedup"] < 1 and not slower["within_spread"]


samples = st.lists(st.floats(min_value=0.01, max_value=1e4, allow_nan=False), min_size=1, max_size=30)


@given(samples, samples, st.floats(min_value=0.1, max_value=10))
def test_the_rule_is_symmetric_scale_free_and_flags_only_overlapping_ranges(a, b, scale):
    sa, sb = bench.summarize(a), bench.summarize(b)
    flagged = bench.versus(sa, sb)["within_spread"]
    assert flagged == bench.versus(sb, sa)["within_spread"]
    if max(b) < min(a) or max(a) < min(b):  # every call of one faster than every call of the other
        assert not flagged
    if sorted(a) == sorted(b):
        assert flagged and bench.versus(sa, sb)["speedup"] == 1.0
    scaled = bench.versus(bench.summarize([x * scale for x in a]), bench.summarize([x * scale for x in b]))
    ratio = sa["median_ms"] / sb["median_ms"]
    if not min(abs(sa["p10_ms"] - sb["p90_ms"]), abs(sb["p10_ms"] - sa["p90_ms"])) < 1e-9 * max(a + b):
        assert scaled["within_spread"] == flagged  # (ranges that just touch may round either way)
    assert scaled["speedup"] == pytest.approx(ratio)


def test_other_work_is_the_machine_s_busy_time_less_this_process_s(monkeypatch):
    machine = itertools.chain([(100.0, 1000.0)], [(150.0, 1200.0)])  # 50 of 200 CPU seconds busy meanwhile
    own = itertools.chain([10.0], [20.0])  # 10 of them this process's
    monkeypatch.setattr(bench, "_machine_cpu_s", lambda: next(machine))
    monkeypatch.setattr(bench.time, "process_time", lambda: next(own))
    with bench.OtherWork() as other:
        pass
    assert other.share == pytest.approx(40 / 200) and not other.busy
    machine = itertools.chain([(100.0, 1000.0)], [(170.0, 1200.0)])
    own = itertools.chain([10.0], [20.0])
    with bench.OtherWork() as other:
        pass
    assert other.share == pytest.approx(60 / 200) and other.busy
    text = bench.busy_warning(other.share, [3.5, 2.0, 1.0])
    assert "30% of the CPUs" in text and "load average 3.50" in text and "not this machine's" in text


def test_without_cpu_counters_a_load_average_above_half_the_cpus_is_busy(monkeypatch):
    monkeypatch.setattr(bench, "_machine_cpu_s", lambda: None)
    monkeypatch.setattr(bench, "cores", lambda: 4)
    for load, busy in ((1.9, False), (2.1, True)):
        monkeypatch.setattr(bench, "load_average", lambda load=load: [load, load, load])
        with bench.OtherWork() as other:
            pass
        assert other.share is None and other.busy is busy
