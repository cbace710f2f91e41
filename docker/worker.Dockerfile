# Adaptation worker: ingest, train, evaluate, bench client, registry (`adapt cycle`).
# GPU hosts: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache
WORKDIR /app
COPY pyproject.toml ./
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" ".[cpu]" psycopg2-binary \
 && pip uninstall -y torchvision torchaudio torchcodec || true
VOLUME ["/state", "/cache"]
ENTRYPOINT ["adapt"]
CMD ["cycle", "--json"]
