"""Benchmarks of gradpatch: scripts that print JSON, in rooms by concern, sharing one harness (benchmarks/README.md).

Run each from the repository's root as a module, ``.venv/bin/python -m benchmarks.<room>.<script>``. Importing this
package imports nothing else (no torch), so that a peer's side script (``benchmarks/peers/<peer>/``) runs in the
peer's own virtualenv.
"""
