"""MEMIT's covariance weight relative to the statistics (``editors.solve.multi_update.relative_update_weight``): the
Mahalanobis norm ``kᵀC⁻¹k`` is scale-free, so one relative weight writes the same fraction of the residual at two
widths and key scales where one absolute ``λ`` does not."""

from __future__ import annotations

import pytest
import torch

from editors import MEMITConfig
from editors.errors import StatisticsError
from editors.solve.multi_update import mahalanobis_norms, memit_factors, relative_update_weight


def _planted(d_in: int, scale: float, n_facts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's second moment ``C`` ``[d_in, d_in]`` from 20·d_in correlated random keys of this scale, and
    ``n_facts`` planted keys ``[F, d_in]`` drawn from the same distribution."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5 + torch.eye(d_in,
                                                                                             dtype=torch.float64)
    corpus = scale * torch.randn(20 * d_in, d_in, generator=g, dtype=torch.float64) @ mix
    keys = scale * torch.randn(n_facts, d_in, generator=g, dtype=torch.float64) @ mix
    return corpus.T @ corpus / corpus.shape[0], keys


def _fraction_written(keys: torch.Tensor, c: torch.Tensor, weight: float) -> float:
    """Mean fraction of each fact's residual the update writes at its own key: ``diag(Uᵀ K)``."""
    residuals = torch.randn(keys.shape[0], 8, dtype=torch.float64)
    u, _ = memit_factors(keys, residuals, c, weight)
    return float(torch.diagonal(u.T @ keys.T).mean())


def test_mahalanobis_norm_is_the_solve_and_scale_free():
    c, keys = _planted(12, 3.0, 4, seed=0)
    m = mahalanobis_norms(keys, c)
    assert m == pytest.approx(torch.stack([k @ torch.linalg.solve(c, k) for k in keys]), rel=1e-9)
    assert mahalanobis_norms(5 * keys, 25 * c) == pytest.approx(m, rel=1e-9)  # units cancel
    per_context = torch.stack([keys, 2 * keys], dim=1)  # [F, P, d_in]
    assert mahalanobis_norms(per_context, c)[:, 1] == pytest.approx(4 * m, rel=1e-9)


def test_one_fact_gets_one_over_one_plus_the_relative_weight():
    c, keys = _planted(20, 0.1, 1, seed=1)
    for alpha in (0.25, 1.0, 4.0):
        weight = relative_update_weight(keys, c, alpha)
        assert _fraction_written(keys, c, weight) == pytest.approx(1 / (1 + alpha), rel=1e-8)


def test_a_relative_weight_carries_across_widths_and_scales_an_absolute_one_does_not():
    # two "models": narrow with large keys, wide with small ones; each edits 6 planted facts
    narrow, wide = _planted(24, 40.0, 6, seed=2), _planted(160, 0.05, 6, seed=3)
    relative = [_fraction_written(k, c, relative_update_weight(k, c, 1.0)) for c, k in (narrow, wide)]
    assert abs(relative[0] - relative[1]) < 0.1 and all(0.3 < f < 0.6 for f in relative)
    # the mean kᵀC⁻¹k of keys like the statistics' is about d_in
    for d_in, (c, k) in ((24, narrow), (160, wide)):
        assert 0.5 * d_in < float(mahalanobis_norms(k, c).mean()) < 2 * d_in
    absolute = [_fraction_written(k, c, 100.0) for c, k in (narrow, wide)]
    assert absolute[1] - absolute[0] > 0.2  # one number is weak at one width and strong at the other


def test_bad_relative_weights_and_statistics_are_refused():
    c, keys = _planted(8, 1.0, 2, seed=4)
    with pytest.raises(ValueError, match="relative_weight must be positive"):
        relative_update_weight(keys, c, 0.0)
    with pytest.raises(StatisticsError, match="not positive definite.*absolute mom2_update_weight"):
        mahalanobis_norms(keys, torch.zeros(8, 8, dtype=torch.float64), node="layer x")
    with pytest.raises(ValueError, match="mom2_relative_weight must be positive"):
        MEMITConfig(mom2_relative_weight=-1.0)
    with pytest.raises(ValueError, match="mom2_update_weight must be 0 or positive"):
        MEMITConfig(mom2_update_weight=-5.0)
    assert MEMITConfig().mom2_update_weight is None  # relative by default


@pytest.mark.parametrize("hidden, intermediate", [(32, 64), (48, 160)])
def test_memit_resolves_lambda_from_the_edited_keys_on_two_model_shapes(hidden, intermediate):
    from editors import Corpus, EditRequest
    from editors.memit import MEMIT
    from editors.statistics.keys import context_activations
    from gradpatch import PatchableGraph
    from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

    tok = byte_level_tokenizer()
    model = tiny_llama(len(tok), hidden=hidden, intermediate=intermediate)
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    node = "model.layers_1.mlp.down_proj"
    requests = [EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
                EditRequest("I think the answer is {}", "the bridge", "Paris"),
                EditRequest("Because it rains, we stay home in {}", "Madrid", "Rome")]
    config = MEMITConfig(n_samples=32, max_length=64, progress=False, use_cache=False, clamp_factor=500.0,
                         context_length_params=((5, 4), (10, 4)), steps=2, subject_first_key=False)
    memit = MEMIT(pg, tok, [node], config, corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))
    batch = memit.compute(requests)
    facts = [(r.prompt, r.subject) for r in requests]
    keys = context_activations(pg, memit.tokenizer, [memit.layers[0].input_node], facts,
                               memit.templates().subset(config.key_prefixes), max_tokens=config.max_tokens)[0]
    keys = keys.mean(dim=1).to(torch.float64)  # k* per fact, [F, d_in]
    c = memit.statistics()[0].matrix
    recorded = batch.info["layers"][0]["mom2_update_weight"]
    assert recorded == pytest.approx(config.mom2_relative_weight * float(mahalanobis_norms(keys, c).mean()), rel=1e-6)
    written = torch.diagonal(batch.edits[0].u.T @ keys.T)  # the fraction of each fact's residual written
    # one fact alone would get m / (λ + m), on average about 1 / (1 + weight) (less where its m is below the mean;
    # three facts share the update), whatever the width: 0.62 at width 64 and 0.51 at 160 with the default 0.6
    alone = 1 / (1 + config.mom2_relative_weight)
    assert 0.7 * alone < float(written.mean()) < 1.05 * alone, written
