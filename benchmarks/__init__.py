"""Reproducible measurements; each writes its table and the command that produced it to BENCHMARKS.md."""
