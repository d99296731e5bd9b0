"""Held-out accuracy, the compliance gate, pass@k, retention (evaluate) and comparisons across merge runs (compare).
Above modeling, specs and tracking."""
