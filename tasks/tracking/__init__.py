"""MLflow: runs, params, metrics, artifacts, the model registry (runs). Above config."""
