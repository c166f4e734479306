"""The performance regression suite: tok/s and acceptance floors per device, tensor-parallel width, model pair,
workload and method (test_decode.py, floors.py, floors.json), the gate's self-check (test_gate.py), the asv history
(asv_benchmarks/) and GPU reports (gpu_report.sh, profile_round.py, kernel_times.py). docs/testing.md says how to run
them."""
