"""transformer_lens, when installed: ``HookedTransformer`` (models built by TransformerLens can be wrapped like
any ``nn.Module``). ``AVAILABLE`` says whether it imported."""

from __future__ import annotations

try:
    from transformer_lens import HookedTransformer

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    AVAILABLE = False

    class HookedTransformer:  # type: ignore[no-redef]
        """Stand-in: transformer_lens is not installed."""


__all__ = ["AVAILABLE", "HookedTransformer"]
