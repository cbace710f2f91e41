# Adaptation worker: ingest, train, evaluate, bench client, registry (`adapt cycle`).
# GPU hosts: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# PYTHONPATH: the checkout's capture/ (with its C sources) rather than the installed copy.
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app
# gcc builds the native capture decoder (capture/_native) below.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml ./
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" ".[cpu]" psycopg2-binary \
 && pip uninstall -y torchvision torchaudio torchcodec || true
# Built into the image (a host's build directory is not reused).
RUN rm -rf capture/_native/build && python -m capture.native
VOLUME ["/state", "/cache"]
ENTRYPOINT ["adapt"]
CMD ["cycle", "--json"]
