"""Editing: ROME and MEMIT edit cost and quality, the null-space keys, the distributed statistics job.

Each script runs as ``.venv/bin/python -m benchmarks.editing.<script>`` from the repository's root (README.md here)."""
