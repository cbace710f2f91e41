# Airflow 3 with the project installed: DAG tasks import adapt.airflow_tasks.
FROM apache/airflow:3.3.2-python3.11
USER root
# gcc builds the native capture decoder (capture/_native) below.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY --chown=airflow:root pyproject.toml /opt/drafter/pyproject.toml
COPY --chown=airflow:root requirements /opt/drafter/requirements
COPY --chown=airflow:root adapt /opt/drafter/adapt
COPY --chown=airflow:root capture /opt/drafter/capture
COPY --chown=airflow:root serving /opt/drafter/serving
COPY --chown=airflow:root dags /opt/airflow/dags
USER airflow
# The locked environment (exact versions, hash-checked); its Airflow is the base image's own version.
RUN pip install --no-cache-dir --require-hashes --find-links https://download.pytorch.org/whl/cpu/torch/ \
      -r /opt/drafter/requirements/cpu.lock \
 && pip install --no-cache-dir psycopg2-binary
ENV PYTHONPATH=/opt/drafter
# Built into the image (a host's build directory is not reused).
RUN rm -rf /opt/drafter/capture/_native/build && python -m capture.native
