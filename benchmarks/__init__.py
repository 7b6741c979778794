"""Benchmarks: each prints a table and writes JSON with --json PATH."""
