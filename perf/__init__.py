"""The performance regression suite (tok/s and acceptance floors per tensor-parallel width) lives here.

It is built by the performance-suite issue; until then `python -m engine bench` measures the workload matrix.
"""
