"""graphpatch's own test suite run against gradpatch (the compatibility spec), with its import alias and snapshot
verdicts.

Each script runs as ``.venv/bin/python -m benchmarks.graphpatch.<script>`` from the repository's root (README.md
here)."""
