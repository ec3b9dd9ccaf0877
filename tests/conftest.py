import pytest
import torch
from hypothesis import HealthCheck, settings

# Tests run two pytest workers on a 2-core machine; one intra-op thread per worker keeps them from spinning
# against each other (the CPU backend's concurrency comes from its lane threads, not from intra-op threads).
torch.set_num_threads(1)

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
