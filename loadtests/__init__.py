"""Benchmarks and load tests. Never collected by pytest; each has a one-line command in its docstring."""
