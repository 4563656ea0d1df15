"""Trainable interventions: DAS, ReFT and BiPO/CAA, beside pyvene and pyreft where they exist, and the data builders
of their tasks.

Each script runs as ``.venv/bin/python -m benchmarks.interventions.<script>`` from the repository's root (README.md
here)."""
