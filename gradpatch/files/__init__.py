"""Files and loading: atomic writes and checked reads (``atomic.py``), a saved PatchableGraph (``serialization.py``),
model fingerprints (``fingerprint.py``) and model loaders (``loaders.py``: the embedded SmolLM2, a directory or a
GGUF file; ``gguf_cache.py``: the embedded model's converted copy on disk) and the cache folders (``cache.py``).

The door re-exports what the layers above use most.
"""

from .atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors, read_yaml, sha256_hex
from .fingerprint import model_fingerprint
from .loaders import embedded_or_random_model, load_embedded_model, load_model, random_embedded_model

__all__ = ["atomic_write_bytes", "atomic_write_text", "embedded_or_random_model", "load_embedded_model", "load_model",
           "model_fingerprint", "random_embedded_model", "read_json", "read_tensors", "read_yaml", "sha256_hex"]
