"""The container and KServe files say what the CLI takes: every flag the Dockerfile's entrypoint and the
InferenceService's args pass is an option of ``opweave serve``, the CPU torch is installed before opweave (so the
CUDA build is never pulled), and the manifest's probes are the server's health routes. (Docker cannot run here;
this keeps the files from drifting from the code.) The GPU check's scripts likewise: the wheels carried to a
GPU machine without network cover what its image lacks, and its scripts refuse clearly where they cannot run."""

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
                         timeout=600, env=env).stdout
    return set(re.findall(r"--[a-z][a-z-]+", out))


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def test_dockerfile_installs_cpu_torch_first_and_passes_only_known_flags(serve_options):
    text = (ROOT / "Dockerfile").read_text()
    torch_at = text.index('pip install --index-url "${TORCH_INDEX}" "torch==${TORCH}"')
    assert torch_at < text.index('pip install ".[serve]"')
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


# The GPU machine's image, as its package list read (2026-11-17): the packages opweave and its serve extra
# need that it has. It has no network; what it lacks travels as wheels that scripts/gpu_wheels.sh downloads.
GPU_IMAGE_HAS = {"torch", "numpy", "networkx", "rich", "typer", "matplotlib", "prometheus-client", "onnxruntime"}


def test_gpu_wheels_carry_every_dependency_the_gpu_image_lacks():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    needed |= {"fastapi", "uvicorn", "prometheus-client"}  # opweave serve on the GPU (what its server imports)
    script = (ROOT / "scripts/gpu_wheels.sh").read_text()
    pinned = re.search(r"^PINNED=\(([^)]*)\)", script, re.M | re.S).group(1).split()
    carried = {p.split("==")[0] for p in pinned} | {"cachetools"} if '"cachetools' in script else set()
    missing = needed - GPU_IMAGE_HAS - carried
    assert not missing, f"neither in the GPU image nor carried: {missing}"


def test_gpu_check_refuses_an_unknown_stage_before_installing_anything(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "lease", "bogus"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 2
    assert "unknown stage lease" in out.stdout and "lease, lease2" in out.stdout
    assert not (tmp_path / "install.log").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal without a GPU")
def test_dump_trace_without_cuda_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/dump_trace.py"), "googlenet", str(tmp_path / "t.gz")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "needs a GPU" in out.stderr
    assert not (tmp_path / "t.gz").exists()


def test_makefile_picks_torchvision_without_importing_torch():
    """`make setup` picks the torchvision made for the installed torch before anything has installed numpy (torch
    does not require it): a line that imported torch there printed "Failed to initialize NumPy" on a fresh set-up."""
    code = re.search(r"^TORCHVISION_FOR_TORCH := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    no_numpy = "import sys; sys.modules['numpy'] = None\n"  # as in a fresh .venv: `import numpy` fails
    out = subprocess.run([sys.executable, "-c", no_numpy + code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    import torch
    minor = int(torch.__version__.split(".")[1])
    assert out.stdout.strip() == f"torchvision==0.{minor + 15}.*"
