"""airspeed velocity benchmarks (asv.conf.json's benchmark_dir); how to run them: perf/ASV.md."""
