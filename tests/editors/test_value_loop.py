"""The value search's one loop (``editors.value.loop.search_values``): ROME's one-fact search is its batch of one."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from editors import ValueObjective, optimize_value
from editors.value.batch_objective import BatchValueObjective
from editors.value.batch_search import optimize_values
from editors.value.loop import search_values
from gradpatch.errors import NonFiniteError
from gradpatch.finite import StepGuard
from test_batch_value import REQUESTS, TEMPLATES, _setup


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_one_fact_search_equals_the_batched_search_of_one_fact(kind):
    pg, tok, layer, v0 = _setup(kind)
    steps_seen: list[int] = []
    single = optimize_value(ValueObjective(pg, tok, layer, REQUESTS[0], TEMPLATES, v0[0], clamp_factor=500.0),
                            steps=12, early_stop_loss=4.0, callback=lambda step, terms: steps_seen.append(step))
    objective = BatchValueObjective(pg, tok, layer, REQUESTS[:1], TEMPLATES, v0[:1], clamp_factor=500.0,
                                    prefix_cache=False)
    (one,) = optimize_values(objective, steps=12, early_stop_loss=4.0)
    assert 0 < single.steps < 12, "the threshold should stop the search early"
    assert one.steps == single.steps and steps_seen == list(range(single.steps + 1))
    torch.testing.assert_close(one.delta, single.delta, rtol=0, atol=1e-6)
    torch.testing.assert_close(one.v_star, single.v_star, rtol=0, atol=1e-6)
    assert [h["loss"] for h in one.history] == pytest.approx([h["loss"] for h in single.history], abs=1e-6)


class _RootObjective:
    """Two facts with loss ``1 + Σ sqrt(|δ|)``: finite at ``δ = 0``, its gradient there NaN."""

    def __init__(self) -> None:
        self.pg = nn.Linear(2, 2)
        self.v_init = torch.ones(2, 3)

    def chunks(self, facts: Sequence[int]) -> list[list[int]]:
        return [list(facts)]

    def loss(self, delta: torch.Tensor, facts: Sequence[int]) -> dict[str, torch.Tensor]:
        loss = 1 + delta[list(facts)].abs().sqrt().sum(-1)
        return {"loss": loss}

    def project_(self, delta: torch.Tensor) -> None:
        return None

    def release(self, facts: Sequence[int]) -> None:
        return None


def test_a_non_finite_gradient_row_is_named_before_the_update():
    objective = _RootObjective()
    with pytest.raises(NonFiniteError, match=r"fact 0: the gradient of 'delta' is non-finite at step 0"):
        search_values(objective, steps=3, lr=0.1, early_stop_loss=0.0,
                      guard=lambda fact: StepGuard(f"fact {fact}", "fix it"))
    assert objective.pg.weight.requires_grad  # the model's parameters are unfrozen again
