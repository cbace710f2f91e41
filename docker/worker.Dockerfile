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
COPY requirements ./requirements
# The locked environment (exact versions, hash-checked), as scripts/env.sh builds it.
RUN pip install --no-cache-dir --require-hashes -r requirements/uv.txt \
 && uv pip sync --system --require-hashes --find-links "$TORCH_INDEX/torch/" requirements/cpu.lock \
 && pip install --no-cache-dir psycopg2-binary
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
# Built into the image (a host's build directory is not reused).
RUN rm -rf capture/_native/build && python -m capture.native
VOLUME ["/state", "/cache"]
ENTRYPOINT ["python", "-m", "app"]
CMD ["cycle", "--json"]
