# Router/controller image: `adapt controller` (registry → pool reconcile, live-acceptance watch).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app
WORKDIR /app
COPY pyproject.toml ./
COPY requirements ./requirements
# The controller validates heads (torch, CPU wheels suffice) but never runs a model; it takes the
# same locked environment as the worker (exact versions, hash-checked).
RUN pip install --no-cache-dir --require-hashes -r requirements/uv.txt \
 && uv pip sync --system --require-hashes --find-links https://download.pytorch.org/whl/cpu/torch/ requirements/cpu.lock
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
EXPOSE 8090
ENTRYPOINT ["python", "-m", "app"]
CMD ["controller", "--health-host", "127.0.0.1", "--health-port", "8090"]
