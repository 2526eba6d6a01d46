"""Benchmarks of autotune: the figures in BENCHMARKS.md come from ``benchmarks/run.py``."""
