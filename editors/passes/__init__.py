"""Forward passes over a model for editing: tokens and subject positions, the start token put before every text,
activation capture at a node, logits at selected positions only, shared-prefix and tail passes that skip repeated
work, and target log-probabilities.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "layer_inputs": "capture",
    "node_activations": "capture",
    "FIRST_PASS_ROWS": "prefix_cache",
    "MIN_SHARED_TOKENS": "prefix_cache",
    "PrefixCache": "prefix_cache",
    "quiet_extraction": "prefix_cache",
    "supports_prefix_cache": "prefix_cache",
    "Forward": "scoring",
    "SelectedForward": "scoring",
    "mean_target_logprobs": "scoring",
    "target_logprobs_batch": "scoring",
    "logits_at": "selected_logits",
    "output_embedding_input_node": "selected_logits",
    "target_logprobs_at": "selected_logits",
    "row_activations": "shared_prefix",
    "DOCUMENT_SEPARATOR": "start_token",
    "resolve_start_token": "start_token",
    "start_token_tag": "start_token",
    "with_start_token": "start_token",
    "TailPass": "tail_pass",
    "logits_match": "tail_pass",
    "tail_pass_for": "tail_pass",
    "BLOCK_ELEMENTS": "token_log_probs",
    "token_log_probs": "token_log_probs",
    "EncodedPrompt": "tokens",
    "common_prefix_length": "tokens",
    "encode": "tokens",
    "encode_prompt_target": "tokens",
    "encode_subject_prompt": "tokens",
    "format_with_span": "tokens",
    "prompt_and_span": "tokens",
    "sorted_chunks": "tokens",
    "subject_char_span": "tokens",
    "subject_token_range": "tokens",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
