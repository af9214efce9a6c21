"""The GPU benchmark: `bash benchmarks/gpu/run.sh`, or `python -m benchmarks.gpu.bench` (docs/performance.md, "On a GPU")."""
