"""What both processes of benchmarks/engine/compile_peers.py share: a cold inductor cache, dynamo's counts of a cold
compile, the hook-guard setting, and the per-variant rows of a shape's report.

No gradpatch import: nnsight's side (benchmarks/peers/nnsight/compile_side.py, nnsight's virtualenv) imports it too.
Import it before torch: it points inductor at a private, cold cache for this process (FX-graph and AOTAutograd caches
off), removed at exit.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

# Before torch is imported: a cold, private inductor cache for this process and no reuse of whole graphs.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    INDUCTOR_DIR: str | None = tempfile.mkdtemp(prefix="compile_peers_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_DIR
    atexit.register(shutil.rmtree, INDUCTOR_DIR, True)
else:
    INDUCTOR_DIR = None

import torch  # noqa: E402
from torch._dynamo import config as dynamo_config  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402

from benchmarks.harness import seconds_of  # noqa: E402


class RecompileLimitHits(logging.Handler):
    """Collects the functions dynamo names when it hits its recompile limit (they run eagerly from then on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the function named by a recompile-limit warning."""
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) >= 3:
            self.functions.append(str(record.args[2]))  # type: ignore[index]


LIMIT_HITS = RecompileLimitHits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(LIMIT_HITS)


def dynamo_snapshot() -> tuple[int, int, int]:
    """Dynamo's counts so far: unique graphs, graph breaks, recompile-limit hits."""
    from torch._dynamo.utils import counters
    return (int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())),
            len(LIMIT_HITS.functions))


def cold(fn: Callable[[], Any]) -> dict[str, Any]:
    """Seconds of the first (compiling) call, in an empty inductor cache (``fresh_cache``: a new cache directory and
    no kernels in memory, so nothing compiled for an earlier variant is reused), with dynamo's counts for it."""
    before = dynamo_snapshot()
    with fresh_cache():
        seconds = seconds_of(fn)
    after = dynamo_snapshot()
    hits = LIMIT_HITS.functions[before[2]:after[2]]
    return {"cold_compile_s": round(seconds, 2), "graphs": after[0] - before[0],
            "graph_breaks": after[1] - before[1], "recompile_limit_hits": len(hits),
            "recompile_limit_functions": sorted(set(hits))}


def guard_hooks(torch_default: bool) -> bool:
    """Make dynamo guard on module hooks unless ``torch_default`` (compile_peers.py's docstring); returns the
    setting in force."""
    if not torch_default:
        dynamo_config.skip_nnmodule_hook_guards = False
    return not dynamo_config.skip_nnmodule_hook_guards


def max_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |logits − reference| in float32."""
    return float((logits.float() - reference.float()).abs().max())


def hooked_copy(model: torch.nn.Module, layer: int, delta: torch.Tensor) -> torch.nn.Module:
    """A deep copy of ``model`` whose layer ``layer``'s MLP ``down_proj`` output gets ``delta`` added by a hook."""
    hooked = copy.deepcopy(model)
    hooked.model.layers[layer].mlp.down_proj.register_forward_hook(lambda module, inputs, output: output + delta)
    return hooked


def variant_rows(medians: dict[str, float], diffs: dict[str, float], colds: dict[str, dict[str, Any]]
                 ) -> dict[str, dict[str, Any]]:
    """Per variant: median ms, the ratio against ``plain_compiled``, max |logit difference| from ``hook_eager``
    (where measured) and the cold compile's figures (where compiled)."""
    base = medians["plain_compiled"]
    return {name: {"ms": round(medians[name] * 1e3, 2), "ratio_vs_plain_compiled": round(medians[name] / base, 4),
                   **({"max_abs_diff_vs_hook_eager": diffs[name]} if name in diffs else {}), **colds.get(name, {})}
            for name in medians}
