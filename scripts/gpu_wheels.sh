#!/usr/bin/env bash
# The wheels that a GPU machine's python3 lacks, downloaded here into .whl/ (git ignores it) to be copied there
# beside the checkout, for a machine with no network whose image (torch, torchvision, timm, transformers, pytest,
# hypothesis, networkx, numpy, rich, typer, matplotlib, onnxruntime, httpx, grpcio, prometheus-client, ...) has no
# cachetools, which `import opweave` needs, nor FastAPI and uvicorn, which `opweave serve` needs.
#
#   scripts/gpu_wheels.sh            # then, on the GPU machine with .whl/ copied: OUT=DIR scripts/gpu_check.sh lease
#
# Versions are pinned to those that worked there (2026-11-27; newer FastAPI needs OpenTelemetry, which the image lacks
# too), cachetools to this checkout's .venv; built for that machine's CPython 3.12 on x86-64. scripts/gpu_check.sh
# installs whatever .whl/ holds before its stages.
set -euo pipefail
cd "$(dirname "$0")/.."
# Not in the GPU machine's image (its package list, 2026-11-17): opweave's dependencies cachetools, onnx and
# onnxscript (with onnx-ir and ml-dtypes, which it needs; pure Python but ml-dtypes); the serve extra's FastAPI,
# uvicorn and what they need beyond the image (starlette, pydantic and its parts).
PINNED=(fastapi==0.115.12 starlette==0.46.2 pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0
        typing-inspection==0.4.1 uvicorn==0.34.3 onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.5.4)
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
version=$("$PY" -m pip show cachetools 2>/dev/null | sed -n 's/^Version: //p' || true)
specs=("cachetools${version:+==$version}" "${PINNED[@]}")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${specs[@]}"
ls -1 .whl
du -sh .whl
