"""Sparse dictionaries: exactness of splicing, file layouts against SAELens, sparsify and circuit-tracer, training
against sparsify, end-to-end training.

Each script runs as ``.venv/bin/python -m benchmarks.dictionaries.<script>`` from the repository's root (README.md
here)."""
