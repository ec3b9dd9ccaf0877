"""One model source (:func:`opweave.capture.load`): a zoo name or a ``.pt2`` file, built, captured and coarsened,
as every command, the server, the coverage list and the benchmarks get it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opweave import zoo
from opweave.capture import capture, coarsen, load, load_program
from opweave.errors import UsageError


def test_a_zoo_model_is_captured_and_coarsened_unless_asked_not_to():
    module, inputs, coarse = load("deepfm")
    fine = load("deepfm", coarsen=False).captured
    reference = capture(*zoo.create("deepfm"), name="deepfm")
    assert [o.id for o in fine.graph.ops] == [o.id for o in reference.graph.ops]
    assert [o.id for o in coarse.graph.ops] == [o.id for o in coarsen(reference).graph.ops]
    assert len(coarse.graph) < len(fine.graph) and coarse.graph.name == fine.graph.name == "deepfm"
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), zoo.create("deepfm")[0](*zoo.create("deepfm")[1]))


def test_an_image_size_goes_only_to_models_that_take_one():
    """A generic caller (the server, ``opweave run --image-size``) gives one size to every model."""
    _, (image,), _ = load("squeezenet", image_size=64, coarsen=False)
    assert image.shape[-2:] == (64, 64)
    _, (sparse, dense), captured = load("deepfm", image_size=64, coarsen=False)
    assert dense.shape == zoo.create("deepfm")[1][1].shape and captured.graph.name == "deepfm"


def test_batch_size_dtype_and_zoo_options():
    module, (sparse, dense), captured = load("deepfm", batch_size=3, dtype=torch.float64, num_dense=5)
    assert dense.shape == (3, 5) and dense.dtype == torch.float64 and sparse.dtype == torch.int64
    assert next(module.parameters()).dtype == torch.float64
    assert captured.graph.name == "deepfm" and load("deepfm", name="ctr").captured.graph.name == "ctr"


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, y):
        return self.a(x).relu() + self.b(y).sigmoid()


def saved(tmp_path, *, with_examples: bool):
    torch.manual_seed(0)
    model = TwoInputs().eval()
    program = torch.export.export(model, (torch.randn(2, 4), torch.randn(2, 4)))
    if not with_examples:
        program.example_inputs = None
    path = tmp_path / "two_inputs.pt2"
    torch.export.save(program, path)
    return model, path


def test_a_file_is_loaded_with_its_own_example_inputs(tmp_path):
    model, path = saved(tmp_path, with_examples=True)
    module, inputs, captured = load(path)
    assert captured.graph.name == "two_inputs" and len(inputs) == 2
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), model(*inputs))
    assert load(str(path), coarsen=False).captured.graph.name == "two_inputs"  # a string ending in .pt2


def test_a_file_without_example_inputs_gets_zeros_of_its_input_shapes(tmp_path):
    """``opweave.compile(path)`` and the commands' ``--model-file`` captured such a program with no inputs at all
    (only the server made zeros of its placeholders' shapes)."""
    import opweave

    model, path = saved(tmp_path, with_examples=False)
    program = load_program(path)
    assert [(x.shape, x.dtype) for x in program.example_inputs] == [((2, 4), torch.float32)] * 2
    assert all(not x.any() for x in program.example_inputs)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(opweave.compile(path, scheduler="lios")(x, y), model(x, y))


def test_a_file_takes_no_batch_size_dtype_or_options(tmp_path):
    _, path = saved(tmp_path, with_examples=True)
    with pytest.raises(UsageError, match="--batch-size does not apply to two_inputs.pt2"):
        load(path, batch_size=2)
    with pytest.raises(UsageError, match="no dtype or model options"):
        load(path, dtype=torch.float64)
    assert load(path, image_size=64).inputs[0].shape == (2, 4)  # a generic caller's image size: ignored


def test_whether_an_option_was_given_is_asked_only_at_the_doors():
    """Options are resolved once at each door (``opweave.compile``, the ``torch.compile`` backend, the command line)
    and handed down resolved: below the doors no module reads ``Options.given`` (the serving executors, the
    server's assembly and the ranks' target did)."""
    from pathlib import Path

    import opweave

    root = Path(opweave.__file__).parent
    doors = {"api.py", "dynamo.py", "pipeline/options.py"}
    readers = {str(p.relative_to(root)) for p in root.rglob("*.py") if ".given" in p.read_text()}
    assert {r for r in readers if not r.startswith("cli/")} <= doors, readers


def test_the_server_builds_no_block_of_its_own():
    """Every block a server compiles is built by the pipeline (``opweave.pipeline.flow.build``): serve/ holds no
    builder and calls no segment compiler (its executors kept one, with their own thread counts and lock)."""
    import re
    from pathlib import Path

    import opweave

    serve = Path(opweave.__file__).parent / "serve"
    for path in serve.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from opweave\.backends\.(compilers|segments) import|import opweave\.backends\."
                             r"(compilers|segments)|from opweave\.backends import (compilers|segments))", text,
                             re.M), path.name


def test_no_file_of_the_server_is_over_500_lines():
    """serve/ was 18 files side by side, its server.py near 1000 lines (metrics, the guard, the app, the HTTP
    protocol with its limits, the lifecycle and a test harness): now rooms, each file under 500 lines."""
    from pathlib import Path

    import opweave

    serve = Path(opweave.__file__).parent / "serve"
    long = {str(p.relative_to(serve)): n for p in serve.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_api_reference_has_a_page_for_every_public_package(tmp_path):
    """``make docs`` documents every public package, warning-free (it documented four)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    make = (root / "Makefile").read_text()
    modules = re.search(r"API_MODULES := (.*?)\n\n", make, re.S).group(1).replace("\\\n", " ").split()
    packages = {p.name for p in (root / "src" / "opweave").iterdir() if (p / "__init__.py").exists()} - {"cli"}
    documented = {m.split(".")[1] for m in modules if m.count(".") == 1} | {"capture", "llm", "schedulers", "zoo"}
    assert packages <= documented, packages - documented
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-m", "pdoc", *modules, "--docformat",
                           "restructuredtext", "-o", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for page in ("pipeline", "costs", "plan", "serve", "dynamo", "errors", "testing", "pipeline/options"):
        assert (tmp_path / "opweave" / f"{page}.html").is_file(), page
