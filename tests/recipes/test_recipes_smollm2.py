"""The shipped steer_eiffel.yaml recipe on the embedded SmolLM2-135M-Instruct (slow: loads the real model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradpatch import Intervention, PatchableGraph
from recipes import cli

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "steer_eiffel.yaml"
PROMPT = "The Eiffel Tower is located in the city of"


@pytest.mark.slow
def test_steer_eiffel_makes_rome_the_greedy_continuation(tmp_path, smollm2):
    torch.set_num_threads(2)
    assert cli.main(["fit", "--config", str(CONFIG), "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 0
    run = tmp_path / "steer_eiffel" / "version_0"

    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    loss = [event.value for event in accumulator.Scalars("loss/total")]
    probability = [event.value for event in accumulator.Scalars("prob/target")]
    assert len(loss) == 20 and loss[-1] < 0.5 * loss[0]
    assert probability[-1] > 0.3 > probability[0]
    (text,) = accumulator.Tensors("generations/text_summary")
    first_row = text.tensor_proto.string_val[0].decode().splitlines()[2]
    assert PROMPT in first_row and "` Paris" in first_row and "` Rome" in first_row  # before | after

    model, tokenizer = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        assert tokenizer.decode(pg(ids, use_cache=False).logits[0, -1].argmax()) == " Paris"
        with pg.patch(Intervention.load(run / "intervention", graph=pg, model=model)):
            assert tokenizer.decode(pg(ids, use_cache=False).logits[0, -1].argmax()) == " Rome"
