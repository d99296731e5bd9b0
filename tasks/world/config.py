"""The built-in world's config: which routes exist and how their prompt sets are generated (the ``world`` section of
every flow config, used only when no route spec is given)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from tasks.common.config_base import _Config
from tasks.world.domains import BUDGETS, DOMAINS, Route, all_routes, check_route, check_template


class WorldConfig(_Config):
    """The built-in world: which routes exist and how their prompt sets are generated."""

    routes: list[str] = Field(
        default_factory=lambda: ["shift-low", "shift-high", "rev-low", "rev-high", "sort-low", "sort-high"],
        description="Routes to build, each DOMAIN-BUDGET (e.g. rev-high), domain in shift/rev/sort/count, budget "
        "low/high/long; 'all' = the 12 routes of the built-in world.",
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt generator (the prompt sets are deterministic in it).")
    train_size: int = Field(3000, ge=1, le=1_000_000, description="Training prompts per route.")
    eval_size: int = Field(200, ge=1, le=100_000, description="Held-out evaluation prompts per route.")
    # The long routes get longer problems so that their trace is >= 40 characters (sort-long's always is).
    min_len: dict[str, int] = Field(
        default_factory=lambda: {"shift": 2, "rev": 2, "sort": 3, "count": 4,
                                 "shift-long": 5, "rev-long": 5, "count-long": 5},
        description="Shortest problem per domain (letters for shift, rev and count, digits for sort); an entry for a "
        "route (e.g. rev-long) overrides its domain's.",
    )
    max_len: dict[str, int] = Field(
        default_factory=lambda: {"shift": 6, "rev": 6, "sort": 10, "count": 8,
                                 "shift-long": 6, "rev-long": 6, "count-long": 6},
        description="Longest problem per domain; an entry for a route overrides its domain's.",
    )
    prompt_files: dict[str, str] = Field(
        default_factory=dict,
        description="Optional route -> JSONL or parquet file with a 'problem' column, used instead of generated prompts.",
    )
    budget_templates: dict[str, str] = Field(
        default_factory=dict,
        description="Optional budget -> prompt template with {bos} {domain} {budget} {problem}, ending in '='.",
    )

    @field_validator("routes")
    @classmethod
    def _routes(cls, v: list[str]) -> list[str]:
        if v == ["all"]:
            v = [r.name for r in all_routes()]
        if not v:
            raise ValueError("at least one route is needed")
        for r in v:
            check_route(Route.parse(r))
        if len(set(v)) != len(v):
            raise ValueError(f"routes repeat: {v}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "WorldConfig":
        keys = set(self.min_len) | set(self.max_len)
        for key in sorted(keys - set(DOMAINS)):
            try:
                check_route(Route.parse(key))
            except ValueError as e:
                raise ValueError(
                    f"min_len/max_len key {key!r} is neither a domain {sorted(DOMAINS)} nor a route: {e}") from None
        for name in sorted(keys | set(self.routes)):
            lo, hi = self.lengths(name)
            if lo is None or hi is None:
                raise ValueError(f"min_len and max_len need an entry for {name!r} (or its domain)")
            if not 1 <= lo <= hi <= 40:
                raise ValueError(f"{name!r}: need 1 <= min_len ({lo}) <= max_len ({hi}) <= 40")
        for r in self.prompt_files:
            if r not in self.routes:
                raise ValueError(f"prompt_files names route {r!r}, which is not in routes {self.routes}")
        for budget, template in self.budget_templates.items():
            if budget not in BUDGETS:
                raise ValueError(f"budget_templates names budget {budget!r}; known: {list(BUDGETS)}")
            check_template(template)
        return self

    def route_objs(self) -> list[Route]:
        return [Route.parse(r) for r in self.routes]

    def lengths(self, name: str) -> tuple[int | None, int | None]:
        """(min_len, max_len) of a route (``rev-long``: its own entries, else its domain's) or of a domain."""
        domain = name.split("-", 1)[0]
        return self.min_len.get(name, self.min_len.get(domain)), self.max_len.get(name, self.max_len.get(domain))
