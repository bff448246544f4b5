# spruce's server image, built from this source tree with every optional backend (`spruce[all]`: Triton, FlashInfer).
#   docker build -t spruce .
#   docker run --gpus all --ipc=host -p 30000:30000 -v /path/to/models:/models spruce /models/Llama-3.1-8B-Instruct
# Arguments after the image name are `spruce serve` flags (SGLang's or vLLM's names); the server listens on
# 0.0.0.0:30000. Probes: /health (the engine runs) and /ready (a request would be admitted now).
# The devel image carries the CUDA compiler and gcc that Triton and FlashInfer compile their kernels with at run time.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/spruce
ENV PATH=/opt/spruce/bin:$PATH

WORKDIR /opt/spruce/src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[all]"

EXPOSE 30000
ENTRYPOINT ["spruce", "serve", "--host", "0.0.0.0", "--port", "30000"]
