# MLflow tracking server + registry (Postgres backend, artifacts proxied to S3).
FROM python:3.11-slim
COPY requirements/uv.txt requirements/mlflow-server.lock /tmp/requirements/
# Locked (exact versions, hash-checked): the project's MLflow, psycopg2 and boto3 (requirements/mlflow-server.in).
RUN pip install --no-cache-dir --require-hashes -r /tmp/requirements/uv.txt \
 && uv pip sync --system --require-hashes --compile-bytecode /tmp/requirements/mlflow-server.lock \
 && rm -rf /tmp/requirements
EXPOSE 5000
ENTRYPOINT ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
