"""The value search from the residual stream after the edited block (editors.passes.tail_pass): the same losses and
gradients as the patched full passes, the decoder's layers left as they were, and full passes where adding δ to the
stream is not what the patch does or the model has no such decoder."""

from __future__ import annotations

import pytest
import torch

from editors import ContextPrefixes, EditRequest, resolve_layer
from editors.passes.tail_pass import TailPass, tail_pass_for
from editors.value.batch_objective import BatchValueObjective
from editors.value.search import frozen_parameters
from gradpatch import PatchableGraph
from gradpatch.model_io import wrapped_model
from gradpatch.testing import byte_level_tokenizer, tiny_gpt2, tiny_llama

TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
REQUESTS = [EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
            EditRequest("{} is the capital of", "Madrid", "Berlin")]
NODE = "model.layers_1.mlp.down_proj"


def _graph(model_fn=tiny_llama):
    tok = byte_level_tokenizer()
    model = model_fn(len(tok), layers=3)
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg.eval(), tok


def _terms(objective: BatchValueObjective, delta: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """Each fact's loss and the gradient of their sum with respect to ``delta``."""
    delta.grad = None
    with frozen_parameters(objective.pg), torch.enable_grad():
        loss = objective.loss(delta, [0, 1])["loss"]
        loss.sum().backward()
    return loss.detach(), delta.grad.clone()


def _searches(pg, tok, residual_node: str) -> tuple[BatchValueObjective, BatchValueObjective]:
    v0 = torch.randn(len(REQUESTS), resolve_layer(pg, NODE).d_out, generator=torch.Generator().manual_seed(0))
    layer = resolve_layer(pg, NODE)
    full = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0)
    tail = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, tail=TailPass(pg, residual_node))
    return full, tail


def test_tail_pass_gives_the_losses_and_gradients_of_the_patched_full_pass():
    pg, tok = _graph()
    decoder = wrapped_model(pg).get_decoder()
    layers = decoder.layers
    full, tail = _searches(pg, tok, "model.layers_1.output")
    assert tail.tail is not None and tail.tail.start == 2
    delta = torch.nn.Parameter(torch.zeros(len(REQUESTS), resolve_layer(pg, NODE).d_out))
    for scale in (0.0, 0.5, 2.0):  # the first evaluation is at δ = 0 (the KL reference), then away from it
        with torch.no_grad():
            delta.copy_(scale * torch.linspace(-1, 1, delta.numel()).reshape(delta.shape))
        expected_loss, expected_grad = _terms(full, delta)
        loss, grad = _terms(tail, delta)
        assert tail.tail is not None  # it matched the full pass on its first rows and stayed on
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert decoder.layers is layers and len(layers) == 3  # the cut list was put back


def test_tail_pass_falls_back_to_full_passes_where_the_patch_is_not_added_to_that_stream():
    pg, tok = _graph()
    full, tail = _searches(pg, tok, "model.layers_0.output")  # the stream before the edited block
    delta = torch.nn.Parameter(torch.zeros(len(REQUESTS), resolve_layer(pg, NODE).d_out))
    with pytest.warns(UserWarning, match="runs full passes"):
        loss, _ = _terms(tail, delta)
    assert tail.tail is None
    torch.testing.assert_close(loss, _terms(full, delta)[0])


def test_tail_pass_restores_the_layers_when_the_pass_fails():
    pg, tok = _graph()
    tail = TailPass(pg, "model.layers_1.output")
    layers = tail.decoder.layers
    ids = torch.tensor([list(tok("Madrid is")["input_ids"])])
    tail.fill([0], [ids.shape[1]], {"input_ids": ids, "use_cache": False})
    def fail(module, args):
        raise RuntimeError("block failed")

    handle = layers[2].register_forward_pre_hook(fail)  # a block after the cut fails inside the cut decoder
    try:
        with pytest.raises(RuntimeError, match="block failed"):
            tail.logits([0], torch.zeros(1, layers[0].mlp.down_proj.out_features), torch.zeros(1, dtype=torch.long),
                        torch.zeros(1, dtype=torch.long), {"input_ids": ids, "use_cache": False})
    finally:
        handle.remove()
    assert tail.decoder.layers is layers and len(layers) == 3


def test_tail_pass_is_not_offered_without_a_decoder_layers_list():
    pg, _ = _graph(tiny_gpt2)
    assert tail_pass_for(pg, "transformer.h_1.output") is None
    with pytest.raises(ValueError, match="full passes"):
        TailPass(pg, "transformer.h_1.output")
