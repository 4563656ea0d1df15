"""non_finite_names: what every optimisation's StepGuard checks after each step."""

from __future__ import annotations

import math

import torch

from gradpatch.finite import non_finite_names


def test_nan_and_inf_elements_and_floats_are_named_in_order() -> None:
    values = torch.zeros(1000)
    named = {"fine": torch.ones(3, 4), "nan": values.clone().index_fill_(0, torch.tensor([517]), math.nan),
             "loss": math.inf, "inf": values.clone().index_fill_(0, torch.tensor([3]), -math.inf),
             "empty": torch.empty(0), "scalar": 2.5, "ints": torch.arange(5),
             "both": torch.tensor([math.inf, -math.inf])}
    assert non_finite_names(named) == ["nan", "loss", "inf", "both"]


def test_finite_elements_whose_sum_overflows_are_not_named() -> None:
    big = torch.full((8,), 3e38)  # finite float32, their sum is inf
    assert not math.isfinite(float(big.sum()))
    assert non_finite_names({"big": big, "half": big.half().nan_to_num(posinf=6e4)}) == []
