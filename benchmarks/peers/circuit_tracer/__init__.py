"""circuit-tracer's side scripts: run under .peers/circuit_tracer/bin/python (0.5.0) or
.peers/circuit_tracer_d797c82/bin/python by the gradpatch half in its room (benchmarks/peers/README.md)."""
