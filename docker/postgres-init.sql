-- One Postgres for the metadata stores: MLflow's, Airflow's, and the warehouse's catalog (a DuckLake,
-- whose tables the first ingest creates).
CREATE DATABASE mlflow;
CREATE DATABASE airflow;
CREATE DATABASE catalog;
