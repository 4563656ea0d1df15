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
