"""nnsight's side scripts: run under .peers/nnsight/bin/python by the gradpatch half in its room
(benchmarks/peers/README.md)."""
