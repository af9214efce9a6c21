"""Scripts that print figures, run from the repository root as modules: `python -m benchmarks.NAME`
(not shipped: pyproject.toml packages specdec, services and clients only)."""
