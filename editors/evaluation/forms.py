"""The prompt-form suite (issue 50): one rewrite asked in several prompt forms, to see whether an edit holds in forms
CounterFact's prompts do not take.

CounterFact (Meng et al. 2022, §4.2) asks each fact in one relation template (``"The city of {} is located in the
country of"``) and puts its paraphrases behind an unrelated first sentence. A user's prompts take other forms; the
suite asks each fact of a split in:

- ``subject_first``: the text begins with the subject (``"Kyoto is located in the country of"``);
- ``unrelated_sentence``: CounterFact's form, the rewrite prompt behind an unrelated sentence;
- ``question``: a question, then an answer for the model to complete (``"Question: Which country is Kyoto in?
  Answer: It is in"``; a bare ``"Answer:"`` was answered with the true target on none of 100 test cases);
- ``lower_case``: the rewrite prompt with the subject lower-cased (``"The city of kyoto ..."``; none when lower-casing
  changes nothing);
- ``clause``: the subject inside a longer clause (``"Last year my friend, who had never travelled before, visited
  Kyoto, a city in the country of"``).

:func:`candidate_forms` writes a case's candidates from its relation (``P17``, ``P131``, ``P1376``, ``P30``, ``P37``;
other relations get ``unrelated_sentence`` and ``lower_case`` only); :func:`known_forms` keeps those the unedited
model answers with the true target (its greedy next token is the first token of ``" " + target_true``, and
``target_true`` scores above ``target_new``), so a form's score measures the edit, not the model's ignorance. The
suite is a CounterFact file whose cases carry ``form_prompts`` (:class:`~editors.evaluation.counterfact.CounterFactCase`);
``demos/rome/build_forms.py`` builds it, ``gradpatch eval-edit`` reports each form's score under ``forms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.model_io import logits_of, model_device, pad_token_id, right_pad

from ..passes.selected_logits import target_logprobs_at
from .counterfact import CounterFactCase

__all__ = ["FORMS", "UNRELATED_SENTENCES", "candidate_forms", "known_forms"]

#: The form names, in report order.
FORMS: tuple[str, ...] = ("subject_first", "unrelated_sentence", "question", "lower_case", "clause")

#: Unrelated first sentences of the ``unrelated_sentence`` form (CounterFact's paraphrase style), one per case in turn.
UNRELATED_SENTENCES: tuple[str, ...] = ("The kettle began to whistle.", "Nobody answered the phone that day.",
                                        "The bus stopped at the corner.", "She folded the letter twice.",
                                        "It had rained all night.")

#: Per relation: the ``subject_first``, ``question`` and ``clause`` templates (``{}``: the subject).
_RELATION_FORMS: dict[str, dict[str, str]] = {
    "P17": {"subject_first": "{} is located in the country of",
            "question": "Question: Which country is {} in? Answer: It is in",
            "clause": "Last year my friend, who had never travelled before, visited {}, a city in the country of"},
    "P131": {"subject_first": "{} is located in the state of",
             "question": "Question: Which US state is {} in? Answer: It is in the state of",
             "clause": "Last year my friend, who had never travelled before, visited {}, a city in the state of"},
    "P1376": {"subject_first": "{} is the capital of",
              "question": "Question: Which country is {} the capital of? Answer: It is the capital of",
              "clause": "Last year my friend, who had never travelled before, visited {}, the capital of"},
    "P30": {"subject_first": "{} is located on the continent of",
            "question": "Question: Which continent is {} on? Answer: It is in",
            "clause": "Last year my friend, who had never travelled before, visited {}, a country on the continent of"},
    "P37": {"subject_first": "{}'s official language is",
            "question": "Question: What is the official language of {}? Answer: The official language is",
            "clause": "Last year my friend, who had never travelled before, visited {}, a country whose official "
                      "language is"},
}


def candidate_forms(case: CounterFactCase, index: int = 0) -> dict[str, str]:
    """The case's rewrite in each form its relation has (see the module docstring), subject filled in.

    Args:
        case: the case (its ``relation_id``, subject and rewrite prompt).
        index: picks the unrelated sentence (``UNRELATED_SENTENCES[index % 5]``), so neighbouring cases differ.

    Returns:
        Form name -> prompt, in :data:`FORMS` order.
    """
    request = case.request
    templates = _RELATION_FORMS.get(request.relation_id, {})
    forms: dict[str, str] = {}
    for name in FORMS:
        if name in templates:
            forms[name] = templates[name].format(request.subject)
        elif name == "unrelated_sentence":
            forms[name] = f"{UNRELATED_SENTENCES[index % len(UNRELATED_SENTENCES)]} {request.text}"
        elif name == "lower_case" and request.subject.lower() != request.subject:
            forms[name] = request.prompt.format(request.subject.lower())
    return forms


@torch.no_grad()
def known_forms(pg: nn.Module, tokenizer: Any, cases: Sequence[CounterFactCase],
                candidates: Sequence[dict[str, str]], batch_size: int = 32) -> list[dict[str, str]]:
    """The candidate forms the unedited model answers with the true target.

    A form is kept when the model's greedy next token after the prompt is the first token of ``" " + target_true``
    and the mean token log-probability of ``target_true`` is above that of ``target_new``.

    Args:
        pg: the unedited model's PatchableGraph.
        tokenizer: the tokenizer the edits will be scored with (an editor's ``tokenizer``: its start token first).
        cases: the cases; candidates: per case, form name -> prompt (:func:`candidate_forms`).
        batch_size: prompts per forward pass.

    Returns:
        Per case, the kept forms (form name -> prompt).
    """
    flat = [(i, name, prompt) for i, forms in enumerate(candidates) for name, prompt in forms.items()]
    prompts = [prompt for _, _, prompt in flat]
    new = target_logprobs_at(pg, tokenizer, prompts, [cases[i].request.target_new for i, _, _ in flat],
                             batch_size=batch_size)
    true = target_logprobs_at(pg, tokenizer, prompts, [cases[i].request.target_true for i, _, _ in flat],
                              batch_size=batch_size)
    greedy = _next_tokens(pg, tokenizer, prompts, batch_size)
    kept: list[dict[str, str]] = [{} for _ in candidates]
    for (i, name, prompt), n, t, token in zip(flat, new.tolist(), true.tolist(), greedy):
        first = _first_token(tokenizer, prompt, cases[i].request.target_true)
        if t > n and token == first:
            kept[i][name] = prompt
    return kept


def _first_token(tokenizer: Any, prompt: str, target: str) -> int:
    """The first token of ``" " + target`` as it follows ``prompt``."""
    before = list(tokenizer(prompt)["input_ids"])
    return int(list(tokenizer(f"{prompt} {target}")["input_ids"])[len(before)])


def _next_tokens(pg: nn.Module, tokenizer: Any, prompts: Sequence[str], batch_size: int) -> list[int]:
    """The greedy next token after each prompt."""
    device, pad, out = model_device(pg), pad_token_id(tokenizer), []
    for start in range(0, len(prompts), batch_size):
        rows = [list(tokenizer(p)["input_ids"]) for p in prompts[start : start + batch_size]]
        ids, lengths = right_pad(rows, pad)
        logits = logits_of(pg(ids.to(device), use_cache=False))
        last = logits[torch.arange(len(rows)), (lengths - 1).to(logits.device)]
        out += last.argmax(dim=-1).tolist()
    return out
