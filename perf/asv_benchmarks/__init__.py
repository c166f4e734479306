"""airspeed velocity benchmarks (asv.conf.json's benchmark_dir); how to run them: docs/testing.md, "History
with asv"."""
