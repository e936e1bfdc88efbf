"""Peak-memory benchmarks (pytest-benchmark), the baseline gate and the dashboard builder.

``pytest benchmarks -m cpu -p no:xdist --benchmark-json=RESULTS.json`` measures;
``python -m benchmarks.gate RESULTS.json`` compares to the committed baseline and to the published
figures (``--refresh`` makes a clean tree's run the committed figures: baseline, ``results/runs/``,
README table);
``python -m benchmarks.record RESULTS.json`` files a clean tree's run under ``results/runs/``;
``python -m benchmarks.headline [--check]`` writes (checks) the README's figure table;
``python -m benchmarks.dashboard -o results/dashboard.html --readme README.md`` draws the committed
runs and writes the README's headline table from them.
The gate and the dashboard use only the standard library (no torch needed to read results).
"""
