"""Benchmarks: comparison scripts that reuse the flows' tasks (our OPD step against TRL's, vLLM against transformers,
chunked against naive divergence memory, many teachers, OPD against the other merge methods), not flows a user
schedules. Each module's docstring says how to run it (``python -m flows.bench.<name>``) and what it prints; the user
flows are the modules directly in ``flows/``.
"""
