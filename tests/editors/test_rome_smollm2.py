"""ROME end to end on the embedded SmolLM2-135M-Instruct (slow: loads the real model, computes statistics)."""

from __future__ import annotations

import pytest
import torch

from editors import ROME, ROMEConfig, load_edits, score_case
from editors.evaluation.counterfact import CounterFactCase
from editors.rome import DEFAULT_SMOLLM2_NODE
from gradpatch import ProbePatch


@pytest.mark.slow
def test_edit_one_fact_in_smollm2(smollm2, tmp_path) -> None:
    from gradpatch import PatchableGraph

    model, tokenizer = smollm2
    ids = torch.randint(0, 1000, (2, 8))  # example inputs only fix the graph; other shapes run too
    pg = PatchableGraph(model, ids, use_cache=False).eval()
    # A small statistics sample keeps the test short; cached under tmp_path so the user's cache is untouched.
    rome = ROME(pg, tokenizer, DEFAULT_SMOLLM2_NODE, ROMEConfig(n_samples=150, cache_dir=str(tmp_path), progress=False))
    case = CounterFactCase.from_dict({
        "case_id": 7,
        "requested_rewrite": {"prompt": "The {} is located in the city of", "subject": "Eiffel Tower",
                              "target_new": {"str": "Rome"}, "target_true": {"str": "Paris"}},
        "paraphrase_prompts": ["The Eiffel Tower can be found in the city of"],
        "neighborhood_prompts": ["The Louvre is located in the city of", "The capital of France is"],
    })
    weight = rome.layer.weight
    original = weight.detach().clone()
    before = score_case(pg, tokenizer, case)
    assert before["efficacy"] == 0.0 and before["neighborhood"] == 1.0

    edit = rome.edit(case.request)
    after = score_case(pg, tokenizer, case)
    assert after["efficacy"] == 1.0
    assert after["paraphrase"] == 1.0
    assert after["neighborhood"] >= 0.5
    continuation = tokenizer.decode(
        pg.generate(tokenizer(case.request.text, return_tensors="pt").input_ids, max_new_tokens=3, do_sample=False)[0]
    )
    assert "Rome" in continuation

    edit.save(tmp_path / "edit")
    edit.restore(pg)
    assert torch.equal(weight, original)
    assert score_case(pg, tokenizer, case)["efficacy"] == 0.0
    loaded = load_edits(tmp_path / "edit")[0]
    loaded.apply(pg, check_fingerprint=True)
    assert score_case(pg, tokenizer, case)["efficacy"] == 1.0
    loaded.restore(pg)
    assert torch.equal(weight, original)

    # The same edit as a patch on the layer output gives the weight write's layer output to float32 rounding, and
    # logits that differ by rounding only: on this model the same prompt in a batch of 2 instead of 1 moves the
    # logits by 5e-5, a last-bit change of one weight matrix by 2e-5 (measured); weight vs patch mode: 3e-5.
    prompt = tokenizer(case.request.text, return_tensors="pt").input_ids
    outputs, logits = {}, {}
    for mode in ("weight", "patch"):
        loaded.apply(pg, mode=mode)
        with pg.patch({f"{DEFAULT_SMOLLM2_NODE}.output": (probe := ProbePatch())}):
            logits[mode] = pg(prompt, use_cache=False).logits.detach()
        outputs[mode] = probe.activation
        loaded.restore(pg)
    assert float((outputs["patch"] - outputs["weight"]).abs().max()) <= 1e-5
    assert float((logits["patch"] - logits["weight"]).abs().max()) <= 1e-4
    assert torch.equal(weight, original)
