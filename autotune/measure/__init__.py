"""Measured figures: the per-machine store of run and bench results, what plans learn from it, and benches."""
