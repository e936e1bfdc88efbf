"""Support code the repros, tests and benchmarks share: child processes and loopback ranks
(``isolated``), a one-rank spmd mesh (``spmd_mesh``), megatron-core's CUDA shim for CPU runs
(``megatron_cpu``) and the engine smoke matrix (``engine_smoke``). No repro lives here."""
