"""Engine: the cost of a PatchableGraph against the plain model (forward, generate, torch.compile, Lightning) and
nnsight's compiled patched forward beside it.

Each script runs as ``.venv/bin/python -m benchmarks.engine.<script>`` from the repository's root (README.md here)."""
