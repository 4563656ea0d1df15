"""Attribution: gradient attribution (AtP, AtP*, EAP) against the exact activation-patching sweep.

Each script runs as ``.venv/bin/python -m benchmarks.attribution.<script>`` from the repository's root (README.md
here)."""
