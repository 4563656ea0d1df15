"""pg.generate for models like graphpatch's TestModel: a forward without a cache argument, a config without layer
counts, and a transformers model class without GenerationMixin (issue 38)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from gradpatch import ExtractionOptions, PatchableGraph, RecordPatch, ReplacePatch
from gradpatch.generation import cache_argument, default_generation_config, generation_view

VOCABULARY = 16
GREEDY = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 4}


class NoLayersConfig(PretrainedConfig):
    """A config with no ``num_hidden_layers`` (nor any other layer count), as graphpatch's TestModelConfig."""

    model_type = "gradpatch_no_layers"


class NoCacheModel(PreTrainedModel):
    """graphpatch's TestModel in small: a ``PreTrainedModel`` without ``GenerationMixin`` whose forward takes the token
    ids only (no cache argument) and returns ``CausalLMOutput`` logits ``[batch, seq, vocabulary]``."""

    config_class = NoLayersConfig

    def __init__(self, config: NoLayersConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(VOCABULARY, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCABULARY)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> CausalLMOutput:
        hidden = self.embed(input_ids)
        hidden = hidden + torch.tanh(self.mix(hidden.cumsum(dim=1)))  # each position sees the tokens before it
        return CausalLMOutput(logits=self.head(hidden))

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: object) -> dict[str, torch.Tensor]:
        return {"input_ids": input_ids}


class NoCacheGenerativeModel(NoCacheModel, GenerationMixin):
    """The same model with ``GenerationMixin``: its own ``generate`` exists, its forward still takes no cache."""


def _model(cls: type[NoCacheModel]) -> NoCacheModel:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(NoLayersConfig()).eval()


def _greedy(model: nn.Module, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The exact greedy continuation: the whole sequence through the model at every step."""
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=1)
    return ids


@pytest.fixture(params=["compiled", "opaque"])
def no_cache(request) -> tuple[NoCacheModel, PatchableGraph, torch.Tensor]:
    model = _model(NoCacheModel)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    options = ExtractionOptions(skip_compilation=request.param == "opaque", error_on_compilation_failure=True)
    return model, PatchableGraph(model, options, ids), ids


def test_the_models_are_what_graphpatchs_test_model_is():
    model = _model(NoCacheModel)
    assert not hasattr(model, "generate") and not hasattr(model.config, "num_hidden_layers")
    assert cache_argument(model) is None and getattr(model, "generation_config", None) is None


def test_a_model_without_generation_mixin_generates_without_a_cache(no_cache):
    model, pg, ids = no_cache
    generated = pg.generate(ids, **GREEDY)
    assert torch.equal(generated, _greedy(model, ids, 4))
    assert isinstance(pg.generation_config, GenerationConfig)
    # The model is left as it was: its class, no generate, no forward or generation_config of the instance.
    assert type(model) is NoCacheModel and not hasattr(model, "generate")
    assert "forward" not in vars(model) and "generation_config" not in vars(model)


def test_patches_apply_at_every_step_and_each_step_sees_the_whole_sequence(no_cache):
    _, pg, ids = no_cache
    target = torch.full((VOCABULARY,), -1.0)
    target[7] = 1.0
    with pg.patch({"output|logits": [record := RecordPatch(), ReplacePatch(value=target)]}):
        generated = pg.generate(ids, **GREEDY)
    assert generated[0, ids.shape[1]:].tolist() == [7, 7, 7, 7]
    # No cache: every forward pass recomputes the prompt and the tokens generated so far.
    assert [tuple(logits.shape) for logits in record.activations] == [(1, 5 + step, VOCABULARY) for step in range(4)]


def test_a_model_with_generation_mixin_and_no_cache_argument_generates_as_its_own_generate_without_cache():
    model = _model(NoCacheGenerativeModel)
    ids = torch.tensor([[2, 7, 1, 8]])
    pg = PatchableGraph(model, ids)
    expected = model.generate(ids, use_cache=False, **GREEDY)
    assert torch.equal(pg.generate(ids, **GREEDY), expected)
    assert torch.equal(expected, _greedy(model, ids, 4))


def test_the_generation_view_shares_the_model_and_adds_generation_mixin_after_its_class():
    model = _model(NoCacheModel)
    view = generation_view(model)
    assert isinstance(view, GenerationMixin) and isinstance(view, NoCacheModel)
    assert type(view).__mro__[1:3] == (NoCacheModel, PreTrainedModel)  # the model's own methods come first
    assert view.embed is model.embed and view.config is model.config
    assert type(view).prepare_inputs_for_generation is NoCacheModel.prepare_inputs_for_generation
    assert type(generation_view(_model(NoCacheModel))) is type(view)  # one class per model class
    generative = _model(NoCacheGenerativeModel)
    assert generation_view(generative) is generative


def test_default_generation_config():
    model = _model(NoCacheModel)
    assert default_generation_config(model).to_dict() == GenerationConfig.from_model_config(model.config).to_dict()
    generative = _model(NoCacheGenerativeModel)
    copied = default_generation_config(generative)
    assert copied is not generative.generation_config and copied.to_dict() == generative.generation_config.to_dict()
    assert default_generation_config(nn.Linear(2, 2)) is None


def test_a_module_that_is_not_a_transformers_model_cannot_generate():
    pg = PatchableGraph(nn.Linear(2, 2), torch.ones(1, 2))
    assert pg.generation_config is None
    with pytest.raises(TypeError, match="not a transformers PreTrainedModel"):
        pg.generate(torch.ones(1, 2))
