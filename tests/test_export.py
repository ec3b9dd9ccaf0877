"""``opweave export``: a zoo model or the user's own written as an entry of a model repository (``model.pt2`` and a
``config.pbtxt`` saying what the server serves), which ``opweave serve --model-repository`` then serves equal to
eager to tritonclient."""

import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from typer.testing import CliRunner

from opweave import zoo
from opweave.cli import app
from opweave.errors import UsageError
from opweave.serve.repository import Repository
from opweave.serve.repository import export as exporting
from serve_models import Pooled, tiny

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")


def read_config(path) -> "model_config_pb2.ModelConfig":
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_entry_names_and_factories():
    assert exporting.entry_name("squeezenet") == "squeezenet"
    assert exporting.entry_name("timm:resnet18") == "resnet18"
    assert exporting.entry_name("hf:google-bert/bert-base-uncased") == "google-bert_bert-base-uncased"
    model, inputs = exporting.from_factory("serve_models:tiny")
    assert isinstance(model, torch.nn.Module) and inputs[0].shape == (1, 3, 8, 8)
    for spec, needle in (("serve_models", "must be MODULE:FUNCTION"), ("no_such_module:f", "No module named"),
                         ("serve_models:nothing", "has no attribute 'nothing'"),
                         ("serve_models:Tiny", r"must return \(model, example_inputs\), got Tiny")):
        with pytest.raises(UsageError, match=needle):
            exporting.from_factory(spec)


def test_export_writes_what_the_server_serves_and_replaces_only_when_asked(tmp_path):
    """A stacking model gets max_batch_size and dims without the batch; one whose output sums over the batch
    (Pooled) gets max_batch_size 0 and its whole shapes; the repository loads both as written."""
    root = tmp_path / "repo"
    model, inputs = tiny()
    served = exporting.export(model, inputs, root, "tiny", max_batch=4)
    config = read_config(root / "tiny" / "config.pbtxt")
    assert (root / "tiny" / "1" / "model.pt2").is_file() and config.name == "tiny" and config.max_batch_size == 4
    assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in config.input] == [
        ("x", "TYPE_FP32", [3, 8, 8])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("output__0", [10])]
    assert [s.shape for s in served.inputs] == [(-1, 3, 8, 8)]
    with pytest.raises(UsageError, match="already holds model.pt2 .--force replaces it."):
        exporting.export(model, inputs, root, "tiny")
    torch.manual_seed(1)
    pooled = Pooled().eval()
    exporting.export(pooled, (torch.randn(2, 3, 4, 4),), root, "tiny", version=2, max_batch=4, force=True)
    config = read_config(root / "tiny" / "config.pbtxt")
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [2, 3, 4, 4]
    with pytest.raises(UsageError, match="not a plain name"):
        exporting.export(model, inputs, root, "a/b")
    assert sorted(p.name for p in root.iterdir()) == ["tiny"]  # no staging left behind
    from opweave.serve.assemble import make_engine, serving_options

    engine = make_engine({}, device="cpu", policy="static", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    loaded = Repository(engine, {}, root, max_batch=4, control="explicit").load("tiny")
    assert loaded.version == "2" and loaded.max_batch == 1 and [s.shape for s in loaded.inputs] == [(2, 3, 4, 4)]


def test_cli_exports_a_module_of_the_users(tmp_path):
    result = CliRunner().invoke(app, ["export", "mine", str(tmp_path), "--module", "serve_models:tiny",
                                      "--max-batch", "2"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert "wrote" in result.stderr and "opweave serve --model-repository" in result.stderr
    assert read_config(tmp_path / "mine" / "config.pbtxt").max_batch_size == 2
    result = CliRunner().invoke(app, ["export", "mine", str(tmp_path), "--module", "serve_models:tiny"])
    assert result.exit_code == 2 and "--force replaces it" in result.stderr


def test_export_squeezenet_then_serve_the_repository_to_tritonclient_equal_to_eager(tmp_path):
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    root = tmp_path / "repo"
    made = subprocess.run([sys.executable, "-m", "opweave", "export", "squeezenet", str(root), "--image-size", "64"],
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root), "--port", "0",
                             "--grpc-port", "0", "--compiler", "none"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "squeezenet (8 blocks)" in line and "listening on http://127.0.0.1:" in line, proc.stderr.read()
        assert "policy static (the default on a CPU)" in line, line
        http = triton_http.InferenceServerClient(line.strip().rsplit(" ", 1)[1].removeprefix("http://"))
        rpc = triton_grpc.InferenceServerClient(line.split("gRPC on ", 1)[1].split(";", 1)[0])
        assert http.get_model_config("squeezenet")["max_batch_size"] == 8
        reference = zoo.create("squeezenet", image_size=64)[0]
        for batch, client, module in ((2, http, triton_http), (3, rpc, triton_grpc)):
            x = torch.randn(batch, 3, 64, 64)
            item = module.InferInput("x", [batch, 3, 64, 64], "FP32")
            item.set_data_from_numpy(x.numpy())
            got = torch.from_numpy(np.array(client.infer("squeezenet", [item]).as_numpy("output__0")))
            with torch.no_grad():
                assert torch.allclose(got, reference(x), rtol=1e-4, atol=1e-4)
        stats = rpc.get_inference_statistics("squeezenet", as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) == 5 and int(stats["execution_count"]) == 2
        http.close()
        rpc.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_a_model_torch_export_refuses_writes_nothing(tmp_path):
    """The repository's directory was created before torch.export ran, so a model it refuses left one behind."""
    from opweave.serve.repository.export import export

    class Branching(torch.nn.Module):
        def forward(self, x):
            return x + 1 if x.sum() > 0 else x - 1  # a branch on the data: torch.export refuses it

    with pytest.raises(UsageError, match="torch.export cannot export it"):
        export(Branching(), (torch.randn(2, 3),), tmp_path / "repo", "branching")
    assert not (tmp_path / "repo").exists()
