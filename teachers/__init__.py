"""The teacher registry (what a teacher is, the registry file, its API and CLI) and routing prompts to teachers.

CLI: ``python -m teachers --help``.
"""

import tasks  # noqa: F401  (first: the state folder's Prefect/MLflow settings, before either is imported)
