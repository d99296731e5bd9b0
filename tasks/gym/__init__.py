"""The real-model profile's routes: a route spec over reasoning-gym's generators (``routes.yaml``, read like any
user's spec) and the functions that write their worked solutions (:mod:`tasks.gym.solutions`)."""

from pathlib import Path

ROUTES = Path(__file__).with_name("routes.yaml")  # the spec of `--profile real`
