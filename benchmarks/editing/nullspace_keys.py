"""How much of the edited subjects' and of their neighbourhood subjects' keys AlphaEdit's null space holds; prints JSON.

AlphaEdit (Fang et al. 2025, arXiv 2410.02355, §3) projects each layer's update onto the null space of the preserved
keys' second moment ``C`` (:func:`editors.solve.multi_update.null_space_projector`): the update acts on a key ``k`` only
through ``P k``. A neighbourhood prompt ("The city of Benoni is located in the country of", next to the edited
"Vryheid") is protected only if its key has less of itself in that null space than the edited keys have. Per layer
of ``DEFAULT_SMOLLM2_NODES`` and threshold, over the first ``--n-cases`` facts of the bank:

- ``edit_key_in_null`` / ``neighbour_key_in_null``: mean ``‖P k‖ / ‖k‖`` (1: wholly in the null space);
- ``rayleigh_edit`` / ``rayleigh_neighbour``: mean ``kᵀ C k / ‖k‖²`` (generic text's keys along ``k``);
- ``cos_neighbour_to_nearest_edit`` and ``cos_edit_to_nearest_other_edit``: mean cosine to the nearest edited key.

Keys are read at the subject's last token of the bare prompt (no context prefix), on the model as loaded; the
statistics come from the cache (``editors.layer_second_moments``, computed if missing). A neighbour's subject is the
part of its prompt that the rewrite template's ``{}`` matches; prompts of another template are skipped.

Run: ``.venv/bin/python -m benchmarks.editing.nullspace_keys [--cases demos/rome/facts.json] [--n-cases 300]``.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from benchmarks.harness import emit
from editors import editable_graph, resolve_layer
from editors.defaults import DEFAULT_SMOLLM2_NODES
from editors.solve.multi_update import null_space_projector
from editors.statistics.keys import ContextPrefixes, context_activations
from editors.statistics.second_moment import layer_second_moments
from gradpatch.files.loaders import load_model

THRESHOLDS = (2e-2, 1e-2)  # AlphaEditConfig's default, and the value of docs/memit.md's evaluation-set runs


def subjects(cases: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(template, subject)`` of every case's rewrite, and of every neighbourhood prompt the template matches."""
    edited, neighbours = [], []
    for case in cases:
        rewrite = case["requested_rewrite"]
        edited.append((rewrite["prompt"], rewrite["subject"]))
        pattern = re.escape(rewrite["prompt"]).replace(re.escape("{}"), "(.+)")
        for prompt in case["neighborhood_prompts"]:
            match = re.fullmatch(pattern, prompt)
            if match:
                neighbours.append((rewrite["prompt"], match.group(1)))
    return edited, neighbours


def layer_row(node: str, second_moment: torch.Tensor, edit: torch.Tensor, neighbour: torch.Tensor) -> dict:
    """The module docstring's measures at one layer: ``edit`` ``[F, d_in]``, ``neighbour`` ``[N, d_in]``."""
    c, e, n = second_moment.double(), edit.double(), neighbour.double()
    row: dict = {"node": node}
    for threshold in THRESHOLDS:
        projector, dimension = null_space_projector(c, threshold, node=node)
        row[f"null_dimension@{threshold:g}"] = dimension
        for name, keys in (("edit", e), ("neighbour", n)):
            share = (keys @ projector).norm(dim=-1) / keys.norm(dim=-1)
            row[f"{name}_key_in_null@{threshold:g}"] = float(share.mean())
    for name, keys in (("edit", e), ("neighbour", n)):
        row[f"rayleigh_{name}"] = float((((keys @ c) * keys).sum(-1) / keys.norm(dim=-1) ** 2).mean())
    unit_e, unit_n = torch.nn.functional.normalize(e, dim=-1), torch.nn.functional.normalize(n, dim=-1)
    row["cos_neighbour_to_nearest_edit"] = float((unit_n @ unit_e.T).max(dim=-1).values.mean())
    others = unit_e @ unit_e.T - 2 * torch.eye(len(unit_e), dtype=unit_e.dtype)  # not itself
    row["cos_edit_to_nearest_other_edit"] = float(others.max(dim=-1).values.mean())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="demos/rome/facts.json")
    parser.add_argument("--n-cases", type=int, default=300)
    args = parser.parse_args()
    with open(args.cases, encoding="utf-8") as handle:
        edited, neighbours = subjects(json.load(handle)[: args.n_cases])
    model, tokenizer = load_model(None)
    pg = editable_graph(model, tokenizer)
    layers = [resolve_layer(pg, node) for node in DEFAULT_SMOLLM2_NODES]
    statistics = layer_second_moments(pg, tokenizer, layers)
    bare = ContextPrefixes(prefixes=("",))
    nodes = [layer.input_node for layer in layers]
    edit_keys = context_activations(pg, tokenizer, nodes, edited, bare)  # per node [F, 1, d_in]
    neighbour_keys = context_activations(pg, tokenizer, nodes, neighbours, bare)
    rows = [layer_row(layer.path, s.matrix, e[:, 0], n[:, 0])
            for layer, s, e, n in zip(layers, statistics, edit_keys, neighbour_keys)]
    emit({"n_edited": len(edited), "n_neighbours": len(neighbours), "layers": rows}, indent=1)


if __name__ == "__main__":
    main()
