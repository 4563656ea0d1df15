"""pyreft's side scripts: run under .peers/pyreft/bin/python by the gradpatch half in its room
(benchmarks/peers/README.md)."""
