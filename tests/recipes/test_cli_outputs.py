"""What every ``gradpatch`` command that writes ``--out`` shares (:mod:`recipes.cli.outputs`): an earlier run refused
unless ``--overwrite`` (before any model is loaded), a staged folder that replaces ``--out`` whole or leaves it as it
was, the user's umask, and a provenance record in every JSON file."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from recipes import cli
from recipes.cli.outputs import staged_folder, write_json_output
from recipes.errors import OutputExistsError


def _args(out: Path, overwrite: bool = False) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), overwrite=overwrite, prompt="p", command_line=["x", "--out", str(out)])


@pytest.mark.parametrize("command", [
    ["trace"], ["attribute", "--prompts", "p.jsonl"], ["eval-edit", "--method", "rome", "--cases", "c.json"],
    ["eval-rome", "--cases", "c.json"]])
def test_every_out_command_refuses_an_earlier_run_naming_overwrite(tmp_path: Path, command: list[str],
                                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / ("metrics.json" if command[0].startswith("eval") else "run")
    if out.suffix:
        out.write_text("{}")
    else:
        out.mkdir()
        (out / "trace.json").write_text("{}")
    assert cli.main([*command, "--out", str(out)]) == 2
    assert f"--out {out} holds an earlier run; give --overwrite" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == [out.name]


def test_a_staged_folder_replaces_out_whole_with_the_users_umask(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "old.json").write_text("{}")
    mask = os.umask(0o027)
    try:
        with staged_folder(_args(out, overwrite=True)) as folder:
            (folder / "new.json").write_text('{"a": 1}')
            (folder / "plot.png").write_bytes(b"png")
    finally:
        os.umask(mask)
    assert sorted(path.name for path in out.iterdir()) == ["new.json", "plot.png", "provenance.json"]
    assert out.stat().st_mode & 0o777 == 0o750 and sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    stamped = json.loads((out / "new.json").read_text())
    assert stamped["a"] == 1 and stamped["provenance"]["arguments"] == {"out": str(out), "overwrite": True,
                                                                        "prompt": "p"}
    assert set(json.loads((out / "provenance.json").read_text())["files"]) == {"new.json", "plot.png"}


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o027, 0o077])
def test_the_out_folder_has_the_mode_a_plain_mkdir_gives(tmp_path: Path, umask: int) -> None:
    """--out (new, its sub-folders and files) gets the modes that mkdir and open give under the user's umask, not
    tempfile.mkdtemp's 0700."""
    mask = os.umask(umask)
    try:
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "file.json").write_text("{}")
        with staged_folder(_args(tmp_path / "new" / "run")) as folder:
            (folder / "sub").mkdir()
            (folder / "sub" / "file.json").write_text("{}")
    finally:
        os.umask(mask)
    out = tmp_path / "new" / "run"
    folder_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    assert (tmp_path / "plain").stat().st_mode & 0o777 == folder_mode
    assert (tmp_path / "plain" / "file.json").stat().st_mode & 0o777 == file_mode
    assert [path.stat().st_mode & 0o777 for path in (out, out / "sub")] == [folder_mode, folder_mode]
    assert [(out / name).stat().st_mode & 0o777 for name in ("sub/file.json", "provenance.json")] == [file_mode] * 2


def test_a_circuit_folder_written_into_a_new_sub_folder_has_the_users_umask(tmp_path: Path) -> None:
    """save_circuit into a folder that does not exist yet (gradpatch circuit's OUT/prompt_<i>/): its staging folder
    is renamed into place, so it must not be tempfile.mkdtemp's 0700."""
    import torch

    from gradpatch.circuits import AttributionGraph, graph_influence
    from recipes.reports.circuit_report import save_circuit

    rows = torch.zeros(4, 10)  # 2 features, 1 layer x 3 positions of errors, 3 tokens, 2 logits
    rows[0, 5], rows[1, 0], rows[2, 1], rows[3, 6] = 0.5, 2.0, 1.0, 0.3
    graph = AttributionGraph(input_tokens=torch.tensor([4, 5, 6]), layers=[0],
                             active_features=torch.tensor([[0, 1, 7], [0, 2, 3]]), activations=torch.tensor([1.0, 2.0]),
                             logit_tokens=torch.tensor([8, 9]), logit_probabilities=torch.tensor([0.7, 0.2]), rows=rows)
    mask = os.umask(0o027)
    try:
        save_circuit(graph, tmp_path / "run" / "prompt_000", decode=str, prompt="p", slug=None, node_threshold=1.0,
                     edge_threshold=1.0, unpruned=graph_influence(graph))
    finally:
        os.umask(mask)
    out = tmp_path / "run" / "prompt_000"
    assert out.stat().st_mode & 0o777 == 0o750 and (out / "graph.json").stat().st_mode & 0o777 == 0o640
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["prompt_000"]


def test_a_failed_run_leaves_out_as_it_was_and_nothing_beside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "old.json").write_text("{}")
    with pytest.raises(RuntimeError, match="half way"), staged_folder(_args(out, overwrite=True)) as folder:
        (folder / "new.json").write_text("{}")
        raise RuntimeError("half way")
    assert [path.name for path in out.iterdir()] == ["old.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    with pytest.raises(OutputExistsError, match="give --overwrite"), staged_folder(_args(out)) as folder:
        (folder / "new.json").write_text("{}")  # an earlier run appeared meanwhile: refused, the new files removed
    assert [path.name for path in out.iterdir()] == ["old.json"]


def test_a_json_file_output_is_refused_or_written_with_its_provenance(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    write_json_output(_args(out), {"score": 1.0})
    assert json.loads(out.read_text())["provenance"]["command"] == ["gradpatch", "x", "--out", str(out)]
    with pytest.raises(OutputExistsError, match="give --overwrite"):
        write_json_output(_args(out), {"score": 2.0})
    write_json_output(_args(out, overwrite=True), {"score": 2.0})
    assert json.loads(out.read_text())["score"] == 2.0
