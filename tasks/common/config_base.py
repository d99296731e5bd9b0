"""The base of every config: unknown fields refused, assignments validated, a short hash of the values."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
