"""Attribution graphs that scale (docs/circuits.md): ``attribute(max_feature_nodes=N)`` computes only the rows of
the features circuit-tracer's rounds visit, and they are the features (and the graph) that replaying those rounds on
the full graph gives; the graph holds its target rows only (no ``[n, n]`` in memory or on disk); ``gradpatch circuit``
bounds its memory (``--max-memory``), reports its peak, and takes several prompts in one run."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_circuits import tiny_replacement

from gradpatch.circuits import (AttributionGraph, attribute, completeness, compute_influence, logit_weights,
                                normalize_matrix)
from gradpatch.circuits.attribute import memory_per_row
from gradpatch.circuits.backward import measure_saved_bytes
from gradpatch.circuits.edges import FEATURE_CHUNK
from gradpatch.files.loaders import load_model
from recipes import cli
from recipes.cli.memory import PeakMemory, parse_bytes
from recipes.testing import save_tiny_backbone, save_tiny_transcoders


def _prompt(seq: int) -> torch.Tensor:
    return torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(3))


def _replayed(graph: AttributionGraph, limit: int, batch_size: int, update_interval: int = 4) -> torch.Tensor:
    """The features circuit-tracer's rounds visit, replayed on ``graph`` with every row computed (the dense
    adjacency, the rows not yet visited set to 0): a reference written apart from gradpatch.circuits.select."""
    adjacency, weights = graph.adjacency, logit_weights(graph)
    known = torch.zeros(graph.n_nodes, dtype=torch.bool)
    known[graph.logit_start:] = True
    visited = torch.zeros(graph.n_features, dtype=torch.bool)
    while int(visited.sum()) < limit:
        partial = torch.where(known[:, None], adjacency, torch.zeros(()))
        influence = compute_influence(normalize_matrix(partial), weights)[:graph.n_features]
        rank = torch.argsort(influence, descending=True)
        chosen = rank[~visited[rank]][:min(update_interval * batch_size, limit - int(visited.sum()))]
        visited[chosen] = True
        known[chosen] = True
    return visited.nonzero().squeeze(-1)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_rounds_choose_what_a_replay_on_the_full_graph_chooses(name: str) -> None:
    """Same features, and the graph is the full graph's rows and columns of the nodes kept (rows do not depend on
    the batch: within float rounding of the backward pass)."""
    replacement = tiny_replacement(name, _prompt(16))
    full = attribute(replacement, batch_size=8, max_feature_nodes=None)
    for batch, limit in ((2, 30), (8, 20), (3, 257)):
        assert full.n_features > limit
        kept = _replayed(full, limit, batch)
        graph = attribute(replacement, batch_size=batch, max_feature_nodes=limit)
        assert graph.total_features == full.n_features and graph.n_features == limit
        assert torch.equal(graph.active_features, full.active_features[kept])
        assert torch.equal(graph.activations, full.activations[kept])
        keep = torch.cat([kept, torch.arange(full.n_features, full.n_nodes)])
        torch.testing.assert_close(graph.adjacency, full.adjacency[keep][:, keep], rtol=1e-6, atol=1e-7)
        assert graph.nodes == [full.nodes[i] for i in keep.tolist()]


def test_the_graph_holds_only_the_visited_rows_and_stays_complete() -> None:
    """With N features of many: rows ``[N + n_logits, n]``, the memory plan counts those rows (not n²), and each
    target is still its edges plus its bias, the bias holding the contributions of the features left out."""
    replacement = tiny_replacement("llama", _prompt(48))
    graph = attribute(replacement, batch_size=8, max_feature_nodes=12)
    n_rows = 12 + len(graph.logit_tokens)
    assert graph.total_features > 1000 and graph.rows.shape == (n_rows, graph.n_nodes)
    n = graph.total_features + (len(graph.layers) + 1) * graph.n_pos + len(graph.logit_tokens)  # every node
    fixed, _ = memory_per_row(replacement, n, n_rows)  # the rows are made over every node's column
    saved = measure_saved_bytes(replacement)
    chunk = FEATURE_CHUNK * max(s.transcoder.d_out for s in replacement.layers.values()) * 4
    patterns = sum(pattern.untyped_storage().nbytes() for _, pattern in replacement.pattern_values)
    assert fixed == 2 * saved.kept + saved.transient + patterns + chunk + 2 * 4 * n_rows * n
    assert fixed < 4 * n ** 2 / 10
    found = completeness(replacement, graph)
    assert float(found.errors.max()) <= 1e-4
    with torch.no_grad():  # the bias with every active feature removed, as the full graph's is
        deltas = {layer: -(s.constant - s.transcoder.b_dec) for layer, s in replacement.layers.items()}
        for delta in deltas.values():
            delta[:, :1] = 0
        last = replacement.run(1, deltas, -replacement.embeddings).logits[0, -1]
    every = last[graph.logit_tokens] - last.mean()
    assert not torch.allclose(found.biases[graph.n_features:], every)  # the features left out are in the bias


def test_parse_bytes_and_peak_memory() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5G") == 1_500_000_000 and parse_bytes("1000") == 1000
    for bad in ("8 parsecs", "", "GiB", "0"):
        with pytest.raises(ValueError, match="is not a size: write e.g. 8GiB"):
            parse_bytes(bad)
    with PeakMemory("cpu") as memory:  # 64 MiB of fresh anonymous pages, each written (never freed heap reused)
        block = mmap.mmap(-1, 64 * 2**20)
        for offset in range(0, 64 * 2**20, mmap.PAGESIZE):
            block[offset] = 1
        block.close()
    assert memory.kind in ("rss", "process_max_rss") and memory.peak >= memory.before + 60 * 2**20
    assert memory.record()["peak_bytes"] == memory.peak


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny backbone and random ReLU skip transcoders at both MLPs (tests/recipes/test_circuits_cli.py's)."""
    folder = tmp_path_factory.mktemp("circuit_scale")
    model_dir = save_tiny_backbone(folder / "tiny")
    model, _ = load_model(model_dir)
    save_tiny_transcoders(folder / "dictionaries", model)
    return {"model": model_dir, "dictionaries": folder / "dictionaries"}


def _circuit(saved: dict[str, Path], out: Path, *extra: str) -> int:
    return cli.main(["circuit", "--dictionaries", str(saved["dictionaries"]), "--model", str(saved["model"]),
                     "--device", "cpu", "--batch-size", "8", "--max-feature-nodes", "40", "--out", str(out), *extra])


def test_several_prompts_share_one_load_and_get_a_folder_each(saved: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """``--prompt`` repeated and ``--prompts FILE`` (JSON Lines) write OUT/prompt_000/, OUT/prompt_001/, each the
    graph a run of that prompt alone writes (into OUT itself), with its attribution.json (peak memory included)."""
    first, second = "the capital of France is", "one two three four five six"
    assert _circuit(saved, tmp_path / "alone", "--prompt", second, "--max-memory", "1GiB") == 0
    alone = json.loads((tmp_path / "alone" / "attribution.json").read_text())
    assert alone["prompt"] == second and alone["max_memory_bytes"] == 2**30 and alone["features"] == 40
    assert alone["peak_memory"]["kind"] in ("rss", "process_max_rss") and alone["peak_memory"]["peak_bytes"] > 0
    assert "peak memory" in capsys.readouterr().out
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(json.dumps({"prompt": first}) + "\n\n" + json.dumps({"prompt": second, "id": 7}) + "\n")
    for out, option in ((tmp_path / "repeated", ["--prompt", first, "--prompt", second]),
                        (tmp_path / "file", ["--prompts", str(lines)])):
        assert _circuit(saved, out, *option) == 0
        assert {path.name for path in out.iterdir()} == {"prompt_000", "prompt_001", "prompts.json",
                                                         "provenance.json"}
        listing = json.loads((out / "prompts.json").read_text())
        assert [p["prompt"] for p in listing["prompts"]] == [first, second]
        assert [p["folder"] for p in listing["prompts"]] == ["prompt_000", "prompt_001"]
        for index, prompt in enumerate((first, second)):
            folder = out / f"prompt_{index:03d}"
            summary = json.loads((folder / "attribution.json").read_text())
            assert summary["prompt"] == prompt and summary["provenance"]["arguments"]["out"] == str(out)
            assert json.loads((folder / "graph.json").read_text())["metadata"]["prompt"] == prompt
        ours, theirs = (load_file(path / "adjacency.safetensors") for path in (out / "prompt_001", tmp_path / "alone"))
        torch.testing.assert_close(ours["rows"], theirs["rows"], rtol=1e-5, atol=1e-6)
        files = json.loads((out / "provenance.json").read_text())["files"]
        assert "prompt_000/adjacency.safetensors" in files and "prompt_001/attribution.json" in files


@pytest.mark.parametrize("case", ["both", "neither", "no_prompt_key", "size", "too_small"])
def test_bad_prompts_and_bounds_exit_with_status_2(saved: dict[str, Path], tmp_path: Path, case: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    extra = {"both": ["--prompt", "a b", "--prompts", str(lines)], "neither": [],
             "no_prompt_key": ["--prompts", str(lines)], "size": ["--prompt", "a b", "--max-memory", "8 parsecs"],
             "too_small": ["--prompt", "a b", "--max-memory", "1KiB"]}[case]
    out = tmp_path / "out"
    assert _circuit(saved, out, *extra) == 2
    expected = {"both": "--prompt TEXT (repeat it for several) or --prompts FILE, one of them",
                "neither": "--prompt TEXT (repeat it for several) or --prompts FILE, one of them",
                "no_prompt_key": "line 1 has no \"prompt\" string", "size": "is not a size: write e.g. 8GiB",
                "too_small": "max_memory_bytes=1024 holds no row"}[case]
    assert expected in capsys.readouterr().err
    assert not out.exists()
