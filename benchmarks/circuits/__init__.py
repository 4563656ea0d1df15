"""Attribution graphs: size, time, memory and exactness, the command line end to end, and graphs beside
circuit-tracer's.

Each script runs as ``.venv/bin/python -m benchmarks.circuits.<script>`` from the repository's root (README.md here)."""
