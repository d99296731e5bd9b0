"""The flows (Prefect DAGs); each module's docstring says how to run it.

`tasks` is imported first: it puts the state folder's Prefect, MLflow and cache settings in the environment, and
Prefect reads them once, when it is first imported (`python -m flows.base` runs this file before flows/base.py's
`from prefect import flow`).
"""

import tasks  # noqa: F401
