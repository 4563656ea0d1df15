"""The peers' side scripts, each run by its room's script in the peer's own virtualenv (``.peers/<peer>/``, built by
``make peers`` from ``benchmarks/peers/<peer>/requirements*.txt``); they import no gradpatch (README.md here)."""
