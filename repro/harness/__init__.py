"""Support code the repros, tests and benchmarks share: child processes and loopback ranks
(``isolated``), a one-rank spmd mesh (``spmd_mesh``) and the engine smoke matrix
(``engine_smoke``); megatron-core's CUDA shim for CPU runs ships with the fixes, for users'
tests too (``fixes.testing.megatron_cpu``). No repro lives here."""
