"""saelens's side scripts: run under .peers/saelens/bin/python by the gradpatch half in its room
(benchmarks/peers/README.md)."""
