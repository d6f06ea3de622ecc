"""End-to-end benchmarks of KV-cache offloading (see docs/e2e_benchmark.md)."""
