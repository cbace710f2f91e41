-- One Postgres for both metadata stores.
CREATE DATABASE mlflow;
CREATE DATABASE airflow;
