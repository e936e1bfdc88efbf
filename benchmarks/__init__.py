"""Peak-memory benchmarks (pytest-benchmark), the baseline gate and the dashboard builder.

``pytest benchmarks -m cpu -p no:xdist --benchmark-json=RESULTS.json`` measures;
``python -m benchmarks.gate RESULTS.json`` compares to the committed baseline;
``python -m benchmarks.dashboard RESULTS.json... -o dashboard.html`` draws them.
The gate and the dashboard use only the standard library (no torch needed to read results).
"""
