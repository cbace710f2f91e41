# Router/controller image: `adapt controller` (registry → pool reconcile, live-acceptance watch).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app HOME=/home/adapt
# The stack's one user (uid 50000, gid 0; see worker.Dockerfile).
RUN useradd --uid 50000 --gid 0 --home-dir /home/adapt --create-home --shell /usr/sbin/nologin adapt \
 && mkdir -p /state /cache && chown 50000:0 /state /cache && chmod 0770 /state /cache
WORKDIR /app
COPY pyproject.toml ./
COPY requirements ./requirements
# The controller validates heads (torch, CPU wheels suffice) but never runs a model; it takes the
# same locked environment as the CPU worker (exact versions, hash-checked).
RUN pip install --no-cache-dir --require-hashes -r requirements/uv.txt \
 && uv pip sync --system --require-hashes --compile-bytecode --find-links https://download.pytorch.org/whl/cpu/torch/ requirements/images-cpu.lock
# The project's packages (pyproject.toml's [tool.setuptools] list).
COPY settings ./settings
COPY capture ./capture
COPY traffic ./traffic
COPY headspec ./headspec
COPY targets ./targets
COPY adapt ./adapt
COPY serving ./serving
COPY evaluation ./evaluation
COPY rollout ./rollout
COPY loop ./loop
COPY app ./app
# Bytecode built in (see worker.Dockerfile).
RUN python -m compileall -q /app
USER 50000:0
VOLUME ["/state", "/cache"]
EXPOSE 8090
ENTRYPOINT ["python", "-m", "app"]
CMD ["controller", "--health-host", "127.0.0.1", "--health-port", "8090"]
