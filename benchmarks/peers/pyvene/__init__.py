"""pyvene's side scripts: run under .peers/pyvene/bin/python by the gradpatch half in its room
(benchmarks/peers/README.md)."""
