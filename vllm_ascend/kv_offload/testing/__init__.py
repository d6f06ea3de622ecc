"""Helpers for tests, examples and benchmarks that must run without a model hub."""
