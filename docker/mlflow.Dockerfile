# MLflow tracking server + registry (Postgres backend, artifacts proxied to S3).
FROM python:3.11-slim
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary boto3
EXPOSE 5000
ENTRYPOINT ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
