"""Helpers for tests and benchmarks: offline real models and tiny random ones."""
