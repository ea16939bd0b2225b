"""Benchmarks behind `kvtool bench <name>`: each module exposes a Python API the CLI mirrors."""
