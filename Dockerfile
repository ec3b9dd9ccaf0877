# opweave serve in a container, CPU: the image docs/serving.md's KServe InferenceService runs.
#
#   docker build -t opweave:0.1.0 .
#   docker run -p 8080:8080 -p 8081:8081 -v $PWD/models:/mnt/models:ro opweave:0.1.0
#
# HTTP/REST (KServe v2) on 8080, gRPC on 8081, models from the Triton-layout repository mounted at /mnt/models
# (KServe's storage initializer puts a model's storageUri there). Arguments after the image replace CMD, e.g.
# `docker run opweave:0.1.0 --models squeezenet --image-size 64`.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

# torch first, the CPU build from PyTorch's own index: installing opweave afterwards finds torch satisfied, so no
# step pulls the multi-GB CUDA build from the default index. torchvision is the release made for that torch
# (0.(minor+15)); the zoo's torchvision models need it, and an unpinned one would replace torch. For a GPU image:
# --build-arg TORCH_VARIANT=cu128 (and run with --device cuda).
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG TORCH=2.13.0
ARG TORCHVISION=0.28.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    RAY_USAGE_STATS_ENABLED=0
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH}" "torchvision==${TORCHVISION}" \
    && python -c "import torch; print(torch.__version__)" > /etc/opweave-torch-version \
    && grep -q "+${TORCH_VARIANT}$" /etc/opweave-torch-version

WORKDIR /opt/opweave
COPY pyproject.toml README.md ./
COPY src ./src
# serve: FastAPI, uvicorn, Prometheus, gRPC and the KServe v2 stubs (ONNX Runtime, the CPU engine's default, is a
# dependency)
RUN pip install ".[serve]" \
    && python -c "import torch; print(torch.__version__)" | cmp - /etc/opweave-torch-version \
    && useradd --create-home --uid 1000 opweave

USER opweave
EXPOSE 8080 8081
# SIGTERM drains: requests accepted are answered, new ones refused (503 / UNAVAILABLE), then exit 0
STOPSIGNAL SIGTERM
ENTRYPOINT ["opweave", "serve", "--host", "0.0.0.0", "--port", "8080", "--grpc-port", "8081"]
CMD ["--model-repository", "/mnt/models"]
