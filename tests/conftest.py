import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

from opweave.pipeline import search, tiers

# Tests run two pytest workers on a 2-core machine; one intra-op thread per worker keeps them from spinning
# against each other (the CPU backend's concurrency comes from its lane threads, not from intra-op threads).
torch.set_num_threads(1)

# A compile's later tiers are built in a process of their own, for a minute or more each: the suite's compiles keep
# their first tier (the tier tests turn them on, with a build that takes a second). Servers and CLIs the tests start
# inherit it.
os.environ["OPWEAVE_TIERS"] = "0"

# A measured choice settles each candidate for 20 ms of calls before timing it (thread pools that spin for a time):
# on the suite's tiny models that is hundreds of calls a timed call, for no outcome a test reads. The tests of the
# settling set it.
search.SETTLE_MS = 0.0
# A tier's live race likewise times each block's calls until they add up to 20 ms; its tests count calls on a
# scripted clock (the test of that rule sets it).
tiers.TIMED_MS = 0.0

# A loaded CI machine can make data generation slow; that says nothing about the code under test.
settings.register_profile("opweave", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("opweave")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """The serving tests' small branching model (``serve_models.tiny``) saved by ``torch.export.save``: ``(model,
    path of its .pt2)``."""
    from serve_models import tiny

    model, x = tiny()
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.export.save(torch.export.export(model, x), str(path))
    return model, path


@pytest.fixture
def held(monkeypatch):
    """The process's background builder holding its jobs until the test runs them (``held.run()``): a new size's
    check or build is held back while the test calls."""
    from opweave.backends import builder

    jobs: list = []

    class Held:
        def run(self) -> None:
            while jobs:
                jobs.pop(0)()

    monkeypatch.setattr(builder.BACKGROUND, "submit", lambda key, job, name="": jobs.append(job) or True)
    return Held()


def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``own_pools`` reads the thread pool of an ONNX Runtime session of its own. Once a serving test
    in this worker has made ONNX Runtime's process-wide pool (``opweave.backends.compilers.shared_pool``), ONNX
    Runtime gives no session a pool of its own, so the test then runs in a fresh interpreter, and passes or fails
    there."""
    if pyfuncitem.get_closest_marker("own_pools") is None:
        return None
    from opweave.backends.compilers import pool_made

    if not pool_made():
        return None
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"in a fresh interpreter:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    return True


@pytest.fixture
def four_ms_calls(monkeypatch):
    """Functions ``a`` and ``b`` and the trace of their calls, each call taking 4 ms on the scripted clock the
    settling before a timed call reads (``opweave.costs.timing._now``)."""
    from opweave.costs import timing

    clock = [0.0]
    monkeypatch.setattr(timing, "_now", lambda: clock[0])
    trace: list[str] = []

    def call(name):
        trace.append(name)
        clock[0] += 0.004

    return {name: (lambda name=name: call(name)) for name in "ab"}, trace
