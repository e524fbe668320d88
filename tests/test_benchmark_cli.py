"""benchmarks.cli: the shared command line, and the partial results a long benchmark leaves
when it is cut off before its end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import as_json, partial_path, partial_writer, run_benchmark


class _CutOff(Exception):
    pass


def _measure(stages: int, cut_after: int | None) -> Any:
    def measure(args: argparse.Namespace) -> dict[str, Any]:
        stage_done = partial_writer("probe", args)
        out: dict[str, Any] = {"rows": []}
        for stage in range(stages):
            out["rows"].append(stage * 10)
            stage_done(out, f"stage {stage}")
            if cut_after == stage:
                raise _CutOff
        return out
    return measure


def test_a_run_cut_off_leaves_its_finished_stages(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    out.write_text('{"earlier": "whole run"}\n')
    with pytest.raises(_CutOff):
        run_benchmark("probe", _measure(4, cut_after=1), as_json,
                      ["--quick", "--json", str(out)])
    partial = json.loads(partial_path(out).read_text())
    assert partial["rows"] == [0, 10]
    assert partial["meta"]["partial"] is True and partial["meta"]["last_stage"] == "stage 1"
    assert partial["meta"]["quick"] is True
    # The last whole run's results stay where they were.
    assert json.loads(out.read_text()) == {"earlier": "whole run"}
    assert partial_path(out).name == "probe.partial.json"


def test_a_whole_run_replaces_the_results_and_removes_the_partial(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    assert run_benchmark("probe", _measure(3, cut_after=None), as_json,
                         ["--json", str(out)]) == 0
    whole = json.loads(out.read_text())
    assert whole["rows"] == [0, 10, 20] and "partial" not in whole["meta"]
    assert not partial_path(out).exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_without_json_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_benchmark("probe", _measure(2, cut_after=None), as_json, []) == 0
    assert list(tmp_path.iterdir()) == []
