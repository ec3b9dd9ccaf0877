"""TOP's learning (§V-B, §V-C): the ``top-gpg`` scheduler's partitions are valid stage schedules no worse than they
may be (never below IOS's DP, which searches the same space), MADDPG finds a known best launch interval, and a
trained ``top`` policy trains from the CLI, serves over HTTP with every answer equal to eager, and simulates."""

import asyncio
import json
import subprocess
import sys

import httpx
import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import schedulers, zoo
from opweave.costs.model import from_graph
from opweave.errors import UsageError
from opweave.ir.synth import random_dag
from opweave.learn import gpg, maddpg, policy
from opweave.pipeline import plan_for
from opweave.schedulers import ios, top_gpg
from opweave.serve.assemble import load_models, make_engine, serving_options
from opweave.serve.engine import top
from opweave.testing.serving import BackgroundServer


def check_stage_schedule(graph, costs, sched, max_group_ops=3, max_groups=8):
    """Every stage's groups are its weakly connected components, independent of each other, each at most r ops and
    at most s of them, one stream each; the schedule passes the checks of ``schedulers.run`` and the validator."""
    stages: dict[int, list[str]] = {}
    for op in sched.order:
        stages.setdefault(sched.stage_of[op], []).append(op)
    for ops in stages.values():
        components = list(nx.weakly_connected_components(graph.nx().subgraph(ops)))
        groups: dict[int, set] = {}
        for op in ops:
            groups.setdefault(sched.stream_of[op], set()).add(op)
        assert sorted(map(sorted, components)) == sorted(map(sorted, groups.values()))
        assert len(groups) <= max_groups and all(len(g) <= max_group_ops for g in groups.values())
    for u, v in graph.edge:
        assert sched.stage_of[u] <= sched.stage_of[v]
    plan_for(graph, costs, "top-gpg", streams=max_groups if max_groups < 8 else None)  # lowers and validates


@settings(max_examples=25)
@given(dags(max_ops=24), st.sampled_from(["ideal", "gpu"]), st.sampled_from([None, 2]))
def test_gpg_partitions_are_valid_stage_schedules_never_better_than_the_dp(graph, cost_model, streams):
    costs = from_graph(graph, cost_model)
    sched = schedulers.run("top-gpg", graph, costs, streams=streams)
    check_stage_schedule(graph, costs, sched, max_groups=streams or 8)
    dp = schedulers.run("ios", graph, costs, streams=streams)
    assert sched.predicted_ms >= dp.predicted_ms - 1e-9
    again = schedulers.run("top-gpg", graph, costs, streams=streams)
    assert (again.order, again.stream_of, again.stage_of) == (sched.order, sched.stream_of, sched.stage_of)


@pytest.fixture(scope="module")
def squeeze_blocks():
    return gpg.GpgGraphs.from_zoo(["squeezenet"], seed=3)


def test_gpg_on_combined_zoo_blocks_is_valid_and_close_to_the_dp(squeeze_blocks):
    for k in (1, 3, 6):
        graph, costs = squeeze_blocks.random_combined(k)
        sched = schedulers.run("top-gpg", graph, costs)
        check_stage_schedule(graph, costs, sched)
        dp = schedulers.run("ios", graph, costs)
        assert dp.predicted_ms - 1e-9 <= sched.predicted_ms <= 1.5 * dp.predicted_ms
        # the predicted makespan is the stages' latencies under the cost model, as for the DP
        stages = {}
        for op in sched.order:
            stages.setdefault(sched.stage_of[op], {}).setdefault(sched.stream_of[op], []).append(op)
        assert sched.predicted_ms == pytest.approx(sum(costs.stage_latency_ms(list(g.values()))
                                                       for g in stages.values()))


def test_gpg_weights_round_trip_and_bad_files_are_refused(tmp_path):
    net = top_gpg.GPG()
    path = tmp_path / "w.pt"
    gpg.save(net, path, {"why": "test"})
    loaded = top_gpg.load(path)
    for (k, a), (_, b) in zip(net.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.allclose(a.half().float(), b), k
    assert path.stat().st_size < 400_000 and top_gpg.DEFAULT_WEIGHTS.stat().st_size < 400_000
    torch.save({"format": "something else"}, str(tmp_path / "bad.pt"))
    with pytest.raises(UsageError, match="not an opweave.top-gpg/1 file"):
        top_gpg.load(tmp_path / "bad.pt")
    graph = random_dag(12, 3, seed=1)
    with pytest.raises(UsageError, match="no file"):
        schedulers.run("top-gpg", graph, from_graph(graph), weights=tmp_path / "missing.pt")


def test_gpg_rules_take_the_candidate_with_the_largest_work_or_speed_up():
    """A chain x1 → x2 → x3 → x4 beside a lone y, every op 1 ms, ``ideal`` costs, r = 3. From the whole graph the
    largest-work ending is {x2, x3, x4} ∥ {y} (work 4, stage 3 ms, speed-up 4/3); the highest speed-up one is
    {x4} ∥ {y} (work 2, stage 1 ms, speed-up 2). The rules run Alg. 2 without the network and give valid stage
    schedules."""
    from opweave.ir.graph import Edge, Op, OpGraph

    graph = OpGraph([Op(o, latency_ms=1.0) for o in ("x1", "x2", "x3", "x4", "y")],
                    [Edge("x1", "x2"), Edge("x2", "x3"), Edge("x3", "x4")], "chain-and-one")
    costs = from_graph(graph, "ideal")
    last = {}
    for rule in top_gpg.RULES:
        sched = schedulers.run("top-gpg", graph, costs, rule=rule, weights="no such file: rules read no weights")
        assert sched.options["rule"] == rule and "weights" not in sched.options
        check_stage_schedule(graph, costs, sched)
        final = max(sched.stage_of.values())
        last[rule] = sorted(sorted(op for op in sched.order if sched.stage_of[op] == final and sched.stream_of[op] == s)
                            for s in {sched.stream_of[op] for op in sched.order if sched.stage_of[op] == final})
    assert last == {"work": [["x2", "x3", "x4"], ["y"]], "speedup": [["x4"], ["y"]]}
    with pytest.raises(UsageError, match="rule 'fastest'"):
        schedulers.run("top-gpg", graph, costs, rule="fastest")


@settings(max_examples=15, deadline=None)
@given(dags(max_ops=18), st.sampled_from(["ideal", "gpu"]), st.sampled_from(list(top_gpg.RULES)))
def test_gpg_rules_pick_the_best_feature_at_every_step(graph, cost_model, rule):
    """At every step of a rule's walk the ending removed is one with the largest work (Σ op latency) or the largest
    work / stage-latency bound, among the endings IOS's pruning admits of what is left; never below the DP."""
    costs = from_graph(graph, cost_model)
    sched = schedulers.run("top-gpg", graph, costs, rule=rule)
    assert sched.predicted_ms >= schedulers.run("ios", graph, costs).predicted_ms - 1e-9
    for block in ios.blocks(graph):
        desc = ios.block_descendants(graph, block)
        state = (1 << len(block)) - 1
        for stage in sorted({sched.stage_of[o] for o in block}, reverse=True):
            taken = {o for o in block if sched.stage_of[o] == stage}
            groups = [[o for o in block if o in taken and sched.stream_of[o] == s]
                      for s in sorted({sched.stream_of[o] for o in taken})]

            def value(gs):
                work = sum(costs.latency_ms[o] for g in gs for o in g)
                bound = top_gpg.stage_bound_ms(costs, gs)
                return work if rule == "work" else (work / bound if bound > 0 else 1.0)

            options = [[[block[i] for i in ios._bits(g)] for g in gs] for _, gs in ios.endings(state, desc, 3, 8)]
            assert value(groups) >= max(value(o) for o in options) * (1 - 1e-6)
            state &= ~sum(1 << block.index(o) for o in taken)
        assert state == 0


def test_gpg_training_lowers_the_greedy_makespan_of_its_graphs(tmp_path):
    """REINFORCE with the greedy-rollout baseline, fixed seeds, 160 episodes over four combined squeezenet blocks
    (2-5 sub-blocks): the untrained network's greedy partitions are 9.7 % over the DP's; after training they are
    within 4 % (about 1.04), better than the largest-work rule (1.052), and never below the DP."""
    source = gpg.GpgGraphs.from_zoo(["squeezenet"], seed=1)
    graphs = [source.random_combined(k) for k in (2, 3, 4, 5)]
    valid = [(g, c, schedulers.run("ios", g, c).predicted_ms) for g, c in graphs]
    torch.manual_seed(0)
    net = top_gpg.GPG()
    with top_gpg.one_thread():
        before = gpg.gpg_over_dp(net, valid)
        history = gpg.train(net, graphs * 40, seed=0)
        after = gpg.gpg_over_dp(net, valid)
        work_rule = gpg.gpg_over_dp(None, valid, rule="work")
    assert len(history) == 160 and all(h["greedy_ms"] > 0 for h in history)
    assert 1.0 - 1e-9 <= after < before - 0.02 and after < work_rule, (before, after, work_rule)
    gpg.save(net, tmp_path / "w.pt")  # float16 on disk: the loaded weights schedule about as well
    ratios = [schedulers.run("top-gpg", g, c, weights=tmp_path / "w.pt").predicted_ms / dp_ms for g, c, dp_ms in valid]
    assert min(ratios) >= 1.0 - 1e-9 and sum(ratios) / len(ratios) < before - 0.02


def test_gpg_train_best_keeps_the_weights_that_validated_best():
    """Validation before training and every few episodes; the weights returned score what the curve says of the
    episode kept; the rules are measured on the same graphs; seeds that draw the held-out graphs are refused."""
    source = gpg.GpgGraphs.from_zoo(["squeezenet"], seed=5)
    source.max_parts = 2
    kept = gpg.train_best(source, 6, validate_every=3, validation_per_size=2, seed=5)
    validated = {r["episode"]: r["valid_over_dp"] for r in kept.curve if "valid_over_dp" in r}
    assert sorted(validated) == [-1, 2, 5] and len(kept.curve) == 7
    assert kept.valid_over_dp == min(validated.values()) == validated[kept.episode]
    valid = source.validation(2)
    assert len(valid) == 4 and gpg.gpg_over_dp(kept.net, valid) == pytest.approx(kept.valid_over_dp, abs=1e-12)
    assert set(kept.rules_over_dp) == set(top_gpg.RULES) and min(kept.rules_over_dp.values()) >= 1.0 - 1e-9
    for seed in (gpg.VALIDATION_SEED, gpg.HELD_OUT_SEED):
        with pytest.raises(UsageError, match="validation or benchmark graphs"):
            gpg.train_best(source, 1, seed=seed)


# ---- MADDPG -------------------------------------------------------------------------------------------------------
def test_maddpg_finds_the_best_launch_interval_of_a_small_environment():
    """A launcher agent and one model agent; the reward peaks where the launcher's action is 0.3 (a launch interval
    of 10^(-3*0.7) s) whatever the model agent does; the state is noise. Its reward rises and its action ends near
    0.3 (TOP's network sizes, batch 100, replay 2000)."""
    rng = np.random.default_rng(0)
    agents = maddpg.MADDPG(4, [1, 2], warmup=50, noise=0.2, seed=0)

    def env_reward(action: float) -> float:
        return float(np.exp(-((action - 0.3) / 0.15) ** 2))

    def greedy() -> float:
        return float(np.mean([agents.act(rng.normal(size=4))[0][0] for _ in range(20)]))

    before = greedy()
    rewards, state = [], rng.normal(size=4)
    with top_gpg.one_thread():
        for _ in range(350):
            actions = agents.act(state, explore=True)
            r = env_reward(actions[0][0])
            next_state = rng.normal(size=4)
            agents.store(state, actions, [r, r], next_state)
            agents.update()
            rewards.append(r)
            state = next_state
    after = greedy()
    assert abs(after - 0.3) < 0.08 and abs(before - 0.3) > 0.1, (before, after)
    assert env_reward(after) > 0.75 > env_reward(before) + 0.3
    assert np.mean(rewards[-50:]) > np.mean(rewards[:50])


def test_reward_is_eq_2_and_zscores_are_running_and_clipped():
    lat = [0.5, -1.0]
    r = policy.reward(1.0, lat, 2.0)
    assert r[0] == pytest.approx(np.exp(0.4 * 1.0 - 0.4 * np.mean(lat) - 0.2 * 2.0))
    assert r[2] == pytest.approx(np.exp(0.4 - 0.4 * -1.0 - 0.4))
    z = policy.ZScore()
    assert z.z(5.0) == 0.0
    for x in (1.0, 2.0, 3.0):
        z.add(x)
    assert z.z(3.0) == pytest.approx(1.0) and z.z(100.0) == 3.0


def test_combination_intervals_and_superblocks():
    policy = top.TopPolicy(shipped=False)
    policy.bind({"a": 3, "b": 2}, {"a": 8, "b": 8}, 2)
    # 5 blocks: [0, 1] cut into 5 intervals; the start (H - 1 = 1 per group): every block alone
    start = [(("a", 0),), (("a", 1),), (("a", 2),), (("b", 0),), (("b", 1),)]
    assert policy.groups == start and policy.intervals == pytest.approx({"a": 0.01, "b": 0.01})
    assert policy.combination([[0.5, 0.5], [0.05, 0.1, 0.95], [0.15, 0.9]]) == [
        (("a", 0), ("a", 1), ("b", 0)), (("a", 2), ("b", 1))]
    assert not policy.apply([[0.5, 0.5], [0.05, 0.1, 0.95], [0.15, 0.9]])  # 3 > H = 2: refused, start kept
    assert policy.superblocks == 1 and policy.decisions == 0 and policy.groups == start
    assert policy.intervals == pytest.approx({"a": 0.01, "b": 0.01})
    assert policy.apply([[1.0, 0.0], [0.05, 0.3, 0.95], [0.15, 0.5]])
    assert policy.intervals == pytest.approx({"a": 1.0, "b": 1e-4})
    assert policy.groups == [(("a", 0), ("b", 0)), (("a", 1),), (("b", 1),), (("a", 2),)]


@pytest.mark.parametrize("blocks, h", [({"m": 8}, 4), ({"m": 11}, 4), ({"m": 16}, 4),
                                       ({"i": 11, "r": 16, "s": 8}, 4), ({"m": 5}, 1), ({"a": 2, "b": 3}, 3)])
def test_the_start_is_a_valid_strided_combination_with_room_between_groups(blocks, h):
    """Every block in exactly one group of at most H - 1 (H with H = 1), blocks of a group ⌈K/(H-1)⌉ slots apart,
    and no two groups in neighbouring intervals: one block moved by one interval makes no superblock."""
    policy = top.TopPolicy(shipped=False)
    policy.bind(blocks, dict.fromkeys(blocks, 16), h)
    groups = policy.start_groups()
    slots = [(m, b) for m in blocks for b in range(blocks[m])]
    assert sorted(s for g in groups for s in g) == sorted(slots)
    assert max(len(g) for g in groups) <= max(1, h - 1)
    k = len(slots)
    bins = sorted({int(a * k) for acts in policy.start_actions() for a in acts})
    assert len(bins) == len(groups)
    if len(groups) < k:
        assert min(b - a for a, b in zip(bins, bins[1:], strict=False)) >= 2
    assert policy.apply([[0.5] * len(blocks)] + policy.start_actions()) and policy.groups == groups


class FixedActors:
    """Actors that always answer the same actions (what the policy does with them is under test)."""

    def __init__(self, actions):
        self.actions, self.calls = actions, 0

    def act(self, state):
        self.calls += 1
        self.states = getattr(self, "states", []) + [list(state)]
        return self.actions


@pytest.fixture(scope="module")
def squeezenet_sim():
    from opweave.serve.engine.simulation import SimExecutor

    served = load_models(["squeezenet"], device="sim", max_batch=16)
    return SimExecutor({"squeezenet": served["squeezenet"].blocked}, serving_options("sim"), preset="h100")


def simulate_top(executor, policy, scale: float, duration: float = 0.5):
    from opweave.serve.engine import Engine
    from opweave.serve.engine.simulation import SimClock
    from opweave.serve.loadgen import run_simulated

    engine = Engine(executor, policy, SimClock(), max_queue=64, max_batch=16, max_sub_blocks=4)
    rep, _ = run_simulated(engine, {"squeezenet": 240.0}, duration, seed=3, scale=scale)
    return rep


def test_one_model_state_carries_its_queue_and_the_actors_decide_every_period(squeezenet_sim):
    """With one model TOP's queue deviation is always 0; the state's queue part is the queue length in batches and
    is not all zero under load. The actors are asked every period (T = 0, as trained): once per 50 ms of the run,
    until it has drained; with T above any variance, only once."""
    start = top.TopPolicy(shipped=False)
    start.bind({"squeezenet": 8}, {"squeezenet": 16}, 4)
    actors = FixedActors([np.array([0.9])] + [np.array(a) for a in start.start_actions()])  # 0.4 s: a backlog
    policy = top.TopPolicy(agents=actors)
    rep = simulate_top(squeezenet_sim, policy, 8.0)
    assert actors.calls == policy.decisions and policy.superblocks == 0
    assert rep["elapsed_s"] / 0.05 - 1 <= actors.calls <= rep["elapsed_s"] / 0.05 + 1 and actors.calls >= 10
    queue_part = [x for s in actors.states for x in s[::9]]  # the first of each sample's 9 numbers
    assert max(queue_part) > 0.5
    gated = FixedActors(actors.actions)
    simulate_top(squeezenet_sim, top.TopPolicy(agents=gated, threshold=1e9), 8.0)
    assert gated.calls == 1


def test_superblocks_leave_the_policy_on_its_valid_start_not_on_uncombined_blocks(squeezenet_sim):
    """Actors that answer only superblocks (every block in one interval) never decide; the policy serves on its
    start (every group valid, some of more than one block) and its 10 ms intervals, and answers."""
    actors = FixedActors([np.array([0.0]), np.full(8, 0.5)])
    policy = top.TopPolicy(agents=actors)
    rep = simulate_top(squeezenet_sim, policy, 16.0)
    assert policy.decisions == 0 and policy.superblocks == actors.calls >= 10
    assert policy.groups == policy.start_groups() and sorted(len(g) for g in policy.groups) == [2, 3, 3]
    assert policy.intervals == {"squeezenet": pytest.approx(0.01)} and rep["total"]["answered"] > 0


def test_learning_on_squeezenets_pattern_sustains_more_than_the_untrained_actors(squeezenet_sim, tmp_path):
    """A short training (300 decisions, updates from the 100th transition, fixed seeds) on TOP's SqueezeNet
    pattern: the actors kept sustain a higher scale than the untrained ones, judged on held-out traces that the
    selection never saw."""
    selection = policy.HeldOut(seeds=(101,), duration_s=0.5)
    with top_gpg.one_thread():
        untrained = policy.train(squeezenet_sim, {"squeezenet": 240.0}, steps=0, held_out=selection)
        trained = policy.train(squeezenet_sim, {"squeezenet": 240.0}, steps=300, warmup=100, eval_every=100,
                               scales=(1, 2, 4, 8, 16, 32, 64), held_out=selection)
    assert [e["step"] for e in trained.evals] == [0, 100, 200, 300] and trained.kept_step > 0
    assert trained.evals[0]["scale"] == untrained.evals[0]["scale"]
    judge = policy.HeldOut(seeds=(7, 8), duration_s=0.5)
    before = policy.evaluate(untrained.agents, squeezenet_sim, {"squeezenet": 240.0}, judge)
    after = policy.evaluate(trained.agents, squeezenet_sim, {"squeezenet": 240.0}, judge)
    assert after["scale"] > 2 * before["scale"], (before, after)
    assert untrained.agents.updates == 0 and trained.agents.updates == 201
    path = tmp_path / "p.pt"  # the policy file keeps weights in half precision: the same actions, near enough
    policy.save_agents(trained.agents, path, blocks={"squeezenet": 8}, max_sub_blocks=4, meta=trained.summary())
    loaded = top.load_agents(path, {"squeezenet": 8}, 4)
    for state in np.random.default_rng(0).uniform(0, 2, (20, trained.agents.state_dim)):
        for a, b in zip(trained.agents.act(state), loaded.act(state), strict=True):
            assert np.abs(a - b).max() < 5e-3
    assert path.stat().st_size < 500_000


def test_the_shipped_policy_is_the_default(policy_file, tmp_path, monkeypatch):
    shipped = tmp_path / "top_squeezenet.pt"
    shipped.write_bytes(policy_file.read_bytes())
    monkeypatch.setattr(top, "DATA_DIR", tmp_path)
    chosen = top.TopPolicy()
    chosen.bind({"squeezenet": 8}, {"squeezenet": 16}, 4)
    assert chosen.policy_file == str(shipped) and len(chosen.agents.actors) == 2


# ---- the CLI and the server -----------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("top")
    proc = run_cli("train-policy", "--pattern", "squeezenet:240", "--steps", "40", "--episode-steps", "10",
                   "--warmup", "20", "--eval-every", "20", "--eval-seeds", "5", "--eval-s", "0.1",
                   "--eval-max-scale", "4", "--image-size", "64", "-o", str(d / "p.pt"), "--plot", str(d / "p.png"))
    assert proc.returncode == 0, proc.stderr
    return d / "p.pt"


def test_train_policy_writes_the_actors_and_the_learning_curve(policy_file):
    curve = json.loads(policy_file.with_suffix(".json").read_text())
    assert len(curve["curve"]) == 40 and curve["meta"]["updates"] == 21
    assert curve["meta"]["command"].startswith("opweave train-policy --pattern squeezenet:240 --steps 40")
    assert all(r["reward"] >= 0 for r in curve["curve"])
    assert [e["step"] for e in curve["evals"]] == [0, 20, 40]
    assert policy_file.with_suffix(".png").stat().st_size > 1000
    data = torch.load(str(policy_file), weights_only=True)
    assert data["blocks"] == {"squeezenet": 8} and len(data["actors"]) == 2
    meta = data["meta"]
    assert [e[0] for e in meta["evals"]] == [0, 20, 40] and meta["kept_step"] in (0, 20, 40)
    assert meta["kept_scale"] == max(e[1] for e in meta["evals"]) and meta["start_scale"] == meta["evals"][0][1]


def test_cli_refusals_for_the_top_policy(policy_file, tmp_path):
    proc = run_cli("loadgen", "--simulate", "--pattern", "squeezenet:100", "--policy", "top", "--policy-file",
                   str(tmp_path / "missing.pt"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    with pytest.raises(UsageError, match="no top policy is shipped for a, b .*--policy-file"):
        top.TopPolicy().bind({"b": 2, "a": 3}, {"a": 8, "b": 8}, 4)
    with pytest.raises(UsageError, match="was trained for {'squeezenet': 8} with H=4, not {'squeezenet': 7}"):
        top.load_agents(policy_file, {"squeezenet": 7}, 4)
    proc = run_cli("train-policy", "--pattern", "squeezenet:240", "--scales", "0", "-o", str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and "--scales" in proc.stderr


def test_loadgen_simulates_the_top_policy(policy_file, tmp_path):
    out = tmp_path / "rep.json"
    proc = run_cli("loadgen", "--simulate", "--pattern", "squeezenet:240", "--duration", "0.3", "--image-size", "64",
                   "--policy", "top", "--policy-file", str(policy_file), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["policy"] == "top" and rep["total"]["answered"] == rep["total"]["sent"] > 30


def test_a_trained_top_policy_serves_and_every_answer_equals_eager(policy_file):
    served = load_models(["squeezenet"], max_batch=4, image_size=64)
    engine = make_engine(served, device="cpu", policy="top", policy_options={"policy_file": str(policy_file)},
                         max_batch=4)
    reference = zoo.create("squeezenet", image_size=64)[0]
    with BackgroundServer(engine, served) as url:
        async def send_all():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                async def one(i):
                    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(i))
                    await asyncio.sleep(0.01 * i)
                    r = await c.post("/v2/models/squeezenet/infer", json={"inputs": [
                        {"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": x.flatten().tolist()}]})
                    return x, r
                return await asyncio.gather(*(one(i) for i in range(12)))

        results = asyncio.run(send_all())
    assert engine.policy.decisions + engine.policy.superblocks >= 1  # the actors were asked
    for x, r in results:
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        got = torch.tensor(out["data"]).reshape(out["shape"])
        with torch.no_grad():
            assert torch.allclose(got, reference(x), rtol=1e-4, atol=1e-4)


def test_train_refuses_a_pattern_other_than_the_served_models(squeeze_blocks):
    with pytest.raises(UsageError, match="the executor serves \\['squeezenet'\\], the pattern names \\['resnet50'\\]"):
        policy.train(squeeze_blocks.executor, {"resnet50": 100.0}, steps=1)


def _schedule_in_child(conn, graph, weights):
    sched = schedulers.run("top-gpg", graph, from_graph(graph), weights=weights)
    conn.send(sched.predicted_ms)


def test_gpg_schedules_in_a_forked_child(tmp_path):
    """benchmarks/_common.run_limited forks; torch's second intra-op thread does not survive a fork, so loading the
    weights there hung until the timeout (sched_time's smoke test) before the load ran with one thread."""
    import multiprocessing

    before, child = torch.get_num_threads(), None
    torch.set_num_threads(2)  # conftest runs tests with one; benchmarks run with the default
    try:
        torch.randn(1 << 20).to(torch.float64).sum()  # the parent's intra-op thread pool is up
        weights = tmp_path / "copy.pt"
        weights.write_bytes(top_gpg.DEFAULT_WEIGHTS.read_bytes())  # not in the load cache: the child loads it
        graph = random_dag(20, 4, seed=2)
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_schedule_in_child, args=(send, graph, weights), daemon=True)
        child.start()
        assert receive.poll(300), "the forked child did not answer within 300 s (a hang: the test takes a second)"
        assert receive.recv() == schedulers.run("top-gpg", graph, from_graph(graph), weights=weights).predicted_ms
    finally:
        torch.set_num_threads(before)
        if child is not None and child.is_alive():
            child.kill()
            child.join()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=12), st.data())
def test_gpg_greedy_pick_ignores_last_bit_noise_between_tied_candidates(levels, data):
    """Symmetric candidates score the same up to the last bit, and which bit wins depends on the CPU (deepfm's pinned
    top-gpg schedule differed between two x86 machines): a few ulps of noise must not move the greedy pick, which
    is the first of the tied candidates."""
    x = torch.tensor([level * 0.75 - 2.0 for level in levels], dtype=torch.float32)
    noisy = x.clone()
    for i in range(len(noisy)):
        toward = torch.tensor(data.draw(st.sampled_from([-10.0, 10.0])))
        for _ in range(data.draw(st.integers(0, 3))):
            noisy[i] = torch.nextafter(noisy[i], toward)
    first = int((x == x.max()).nonzero()[0, 0])
    assert top_gpg.greedy(noisy) == top_gpg.greedy(x) == first


def test_gpg_walks_chunks_in_lockstep_as_it_would_walk_each_alone():
    """walk() scores every chunk's step in one network pass: each chunk's stages and latency are those of walking it
    alone, and the batched logits of several states are each state's own (to float rounding)."""
    graph, costs = gpg.GpgGraphs.from_zoo(["squeezenet"], seed=7).random_combined(4)
    net = top_gpg.load()
    index = {o: i for i, o in enumerate(graph.ids)}
    scale = top_gpg.scale_ms(graph, costs)
    chunks = ios.blocks(graph)
    assert len(chunks) > 1
    with torch.inference_mode(), top_gpg.one_thread():
        g2e = net.embed(*top_gpg.encode_inputs(graph, costs))
        together = top_gpg.walk(net, g2e, index, graph, costs, chunks, 3, 8, scale)
        alone = [top_gpg.walk(net, g2e, index, graph, costs, [c], 3, 8, scale)[0] for c in chunks]
        assert together == alone
        steps = []
        for block in chunks:
            desc = ios.block_descendants(graph, block)
            state = (1 << len(block)) - 1
            _, groups_ops, feats = top_gpg.candidates(costs, block, desc, state, 3, 8, scale)
            steps.append((block, desc, state, groups_ops, feats))
        batched = top_gpg.batch_logits(net, g2e, index, steps)
        single = torch.cat([top_gpg.candidate_logits(net, g2e, index, *step) for step in steps])
    assert batched.shape == single.shape and torch.allclose(batched, single, rtol=1e-5, atol=1e-6)
