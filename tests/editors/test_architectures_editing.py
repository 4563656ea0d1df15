"""The architecture matrix's editing cells: ROME (one expert of a mixture of experts where the MLP is one) and MEMIT at
the layout's MLP output projection (``ModelLayout.mlp_out``) of every family in :data:`gradpatch.testing.FAMILIES`:
the edit is effective (P(new) > P(true) after it, the efficacy criterion) and raises the target's probability, touches
only the edited weight and restores bit-identically; MEMIT reads the residual stream at the layout's ``hidden`` and is
refused where the family puts a post-norm or a multiplier between that layer and the residual stream."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from editors import MEMIT, ROME, EditRequest
from editors.config import MEMITConfig, ROMEConfig
from editors.errors import LayerKindError
from editors.passes.scoring import mean_target_logprobs
from editors.statistics import Corpus
from gradpatch import PatchableGraph
from gradpatch.layouts import detect_layout
from gradpatch.model_io import wrapped_model
from gradpatch.testing import FAMILIES, TOY_SENTENCES, byte_level_tokenizer, tiny_causal_lm

# As in tests/editors/test_edit_experts.py: a toy fact ending with its subject, fast settings, a toy corpus.
REQUEST = EditRequest(prompt="The river flows into the sea near {}", subject="the old town", target_new="Rome",
                      target_true="Paris")
SETTINGS: dict[str, Any] = dict(n_samples=32, max_length=64, use_cache=False, progress=False, steps=25,
                                clamp_factor=500.0, context_length_params=((5, 4),))
CORPUS = Corpus(name="toy", texts=list(TOY_SENTENCES) * 4)
#: Families whose fused experts the editors do not read (transposed, with biases): a LayerKindError names the layouts
#: they do.
EXPERTS_REFUSED = {"gpt_oss"}


def _graph(family: str) -> tuple[PatchableGraph, Any]:
    tok = byte_level_tokenizer()
    # init 0.3 (as tiny_llama): transformers' 0.02 gives a near-uniform model that no edit visibly moves
    model = tiny_causal_lm(family, vocab_size=len(tok), initializer_range=0.3)
    return PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval(), tok


def _probabilities(pg: PatchableGraph, tok: Any) -> list[float]:
    """P(target_new), P(target_true) after the rewrite prompt."""
    texts, targets = [REQUEST.text] * 2, [REQUEST.target_new, REQUEST.target_true]
    return mean_target_logprobs(lambda ids: pg(ids, use_cache=False), tok, texts, targets).exp().tolist()


def _parameters(pg: PatchableGraph) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in wrapped_model(pg).named_parameters()}


def _changed(pg: PatchableGraph, before: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, p in wrapped_model(pg).named_parameters() if not torch.equal(p, before[name])]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rome_at_the_layouts_mlp_output_projection(family: str) -> None:
    pg, tok = _graph(family)
    layout = detect_layout(pg)
    node = f"{layout.block(1)}.{layout.mlp_out}"
    if family in EXPERTS_REFUSED:
        with pytest.raises(LayerKindError, match="experts"):
            ROME(pg, tok, node, ROMEConfig(**SETTINGS), corpus=CORPUS)
        return
    rome = ROME(pg, tok, node, ROMEConfig(**SETTINGS), corpus=CORPUS)
    before, params = _probabilities(pg, rome.tokenizer), _parameters(pg)
    edit = rome.edit(REQUEST)
    after = _probabilities(pg, rome.tokenizer)
    assert after[0] > after[1] and after[0] > before[0], (before, after)  # efficacy, and the target rises
    changed = _changed(pg, params)
    assert len(changed) == 1 and changed[0].startswith(layout.block(1).replace("_1", ".1", 1)), changed
    edit.restore(pg)
    assert _changed(pg, params) == [] and _probabilities(pg, rome.tokenizer) == before


#: Families whose MLP is 4 × d_model wide (128): the toy corpus's keys do not span it, so C is singular there and the
#: MEMIT edit itself is not run (its residual stream is still checked).
WIDE_MLP = {"gptj", "falcon"}


@pytest.mark.parametrize("family", ["llama", "gpt2", "gptj", "falcon", "phi3", "gemma2", "olmo2", "granite"])
def test_memit_runs_where_the_layer_adds_to_the_residual_stream_and_is_refused_elsewhere(family: str) -> None:
    pg, tok = _graph(family)
    layout = detect_layout(pg)
    nodes = [f"{layout.block(i)}.{layout.mlp_out}" for i in range(2)]
    if not layout.adds_outputs_unchanged:
        with pytest.raises(LayerKindError, match=f"the '{layout.family}' layout puts a norm or a multiplier"):
            MEMIT(pg, tok, nodes, MEMITConfig(**SETTINGS), corpus=CORPUS)
        return
    memit = MEMIT(pg, tok, nodes, MEMITConfig(**SETTINGS), corpus=CORPUS)
    assert memit.residual_node == layout.path("hidden", 1)  # Falcon's block returns a tuple: ``output|sub_0``
    if family in WIDE_MLP:
        return
    before, params = _probabilities(pg, memit.tokenizer), _parameters(pg)
    batch = memit.edit([REQUEST])
    after = _probabilities(pg, memit.tokenizer)
    assert after[0] > after[1] and after[0] > before[0], (before, after)
    batch.restore(pg)
    assert _changed(pg, params) == []
