-- One database each for Prefect and MLflow in the compose stack's Postgres.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
