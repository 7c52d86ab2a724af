"""Benchmarks behind ``ninfer-bench``: each prints JSON lines, ours next to a baseline."""
