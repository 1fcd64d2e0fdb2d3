"""Benchmarks behind `mpic bench ...`: each prints a table, writes JSON and a PNG plot."""
