"""The container and KServe files say what the CLI takes: every flag the Dockerfile's entrypoint and the
InferenceService's args pass is an option of ``opweave serve``, the CPU torch is installed before opweave (so the
CUDA build is never pulled), and the manifest's probes are the server's health routes. (Docker cannot run here;
this keeps the files from drifting from the code.)"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def serve_options() -> set[str]:
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", "opweave", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, env=env).stdout
    return set(re.findall(r"--[a-z][a-z-]+", out))


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def test_dockerfile_installs_cpu_torch_first_and_passes_only_known_flags(serve_options):
    text = (ROOT / "Dockerfile").read_text()
    torch_at = text.index('pip install --index-url "${TORCH_INDEX}" "torch==${TORCH}"')
    assert torch_at < text.index('pip install ".[serve,onnx]"')
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry[:2] == ["opweave", "serve"]
    assert set(flags(entry + cmd)) <= serve_options, set(flags(entry + cmd)) - serve_options
    assert {"--grpc-port", "--model-repository", "--pin-cores", "--ray"} <= serve_options


def test_inferenceservice_runs_the_image_with_known_flags_and_the_v2_health_routes(serve_options):
    yaml = pytest.importorskip("yaml")
    isvc = yaml.safe_load((ROOT / "deploy" / "kserve-inferenceservice.yaml").read_text())
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    container = isvc["spec"]["predictor"]["containers"][0]
    assert container["name"] == "kserve-container"
    assert set(flags(container["args"])) <= serve_options
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["ports"][0]["containerPort"] == 8080  # the Dockerfile's --port
