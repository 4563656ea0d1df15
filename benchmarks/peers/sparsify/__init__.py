"""sparsify's side scripts: run under .peers/sparsify/bin/python by the gradpatch half in its room
(benchmarks/peers/README.md)."""
