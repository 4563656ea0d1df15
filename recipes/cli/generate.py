"""``gradpatch generate``: greedy continuations with a saved intervention (KV-cache generation).

::

    gradpatch generate --intervention runs/loreft/intervention --prompt "Q: What is the capital of Peru?\\nA:"
    gradpatch generate --intervention runs/bipo/intervention --prompt "I think the movie" --scale 2 --compare

The intervention is loaded with its checks (NodePaths against the model's graph, the model fingerprint it was
saved with); ReFT patches act on the prompt's first/last tokens at the prefill, steering vectors on every token
(:func:`recipes.generation.generate_with_patches`). ``--compare`` also prints the model's continuation without
the intervention.
"""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_device_option, add_model_option, usage_error

__all__ = ["NAME", "register"]

NAME = "generate"


def _run_generate(args: argparse.Namespace) -> int:
    """Run ``gradpatch generate`` (see the module docstring); returns the exit status."""
    from gradpatch import AddPatch, Intervention, PatchableGraph
    from gradpatch.errors import FingerprintMismatchError, InterventionLoadError, SubspaceConfigError
    from gradpatch.files.loaders import default_device, load_model

    from ..errors import RecipeConfigError
    from ..generation import generate_with_patches
    from ..tokens import left_pad, pad_token_id

    if args.max_new_tokens < 1:
        return usage_error(NAME, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    pad = pad_token_id(tokenizer)
    example = left_pad([[pad + 1] * 3, [pad + 1] * 4], pad)
    pg = PatchableGraph(model, example["input_ids"], attention_mask=example["attention_mask"],
                        position_ids=example["position_ids"], use_cache=False)
    try:
        intervention = Intervention.load(args.intervention, graph=pg)
        patches = intervention.patch_map()
        if args.scale != 1.0:
            patches = {path: [AddPatch(value=p.value * args.scale, slice=p.slice) if isinstance(p, AddPatch) else p
                              for p in items] for path, items in patches.items()}
        outputs = generate_with_patches(pg, tokenizer, patches, args.prompt, args.max_new_tokens)
        plain = generate_with_patches(pg, tokenizer, {}, args.prompt, args.max_new_tokens) if args.compare else None
    except (InterventionLoadError, FingerprintMismatchError, SubspaceConfigError, RecipeConfigError, KeyError,
            ValueError) as error:
        return usage_error(NAME, error)
    for i, (prompt, text) in enumerate(zip(args.prompt, outputs)):
        print(f"{prompt!r}\n  intervened: {text!r}")
        if plain is not None:
            print(f"  model:      {plain[i]!r}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``generate`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="greedy continuations with a saved intervention (ReFT patches, steering vectors)",
        description="Load an intervention saved by 'gradpatch fit' (checked against the model) and generate with it "
                    "through the model's KV cache.",
    )
    p.add_argument("--intervention", required=True, metavar="DIR",
                   help="folder with intervention.json and intervention.safetensors")
    p.add_argument("--prompt", required=True, nargs="+", help="one or more prompts")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per continuation (default %(default)s)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply steering vectors (AddPatch values) by this factor (default %(default)s)")
    p.add_argument("--compare", action="store_true", help="also print the continuation without the intervention")
    add_model_option(p)
    add_device_option(p)
    p.set_defaults(func=_run_generate)
