"""Regression bands for the headline figures the README states (its *Headline figures* table): wide enough for noise
on the tests' fixed seeds, narrow enough that a merge that stopped learning falls below them."""

# The quick profile's merge (`make quick`): mean retention 0.785 on 2026-12-01 (world version 4), with transformers
# and with vLLM rollouts and served teachers alike (0.815).
QUICK_MEAN_RETENTION_FLOOR = 0.75
