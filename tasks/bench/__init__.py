"""What the benchmarks in flows/bench/ share: helpers (helpers) and cost-to-target curves (curves). The top of the
tree."""
