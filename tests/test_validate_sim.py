"""`benchmarks/validate_sim.py`'s command line: input it refuses before any cluster starts."""

import sys

import pytest

from benchmarks import validate_sim


def _main(monkeypatch, *args: str):
    monkeypatch.setattr(sys, "argv", ["validate_sim.py", *args])
    return validate_sim.main()


def test_interleaved_runs_need_a_file_each(monkeypatch, capsys, tmp_path):
    # caught before the cluster (which needs root) is built: exit 2 is argparse's usage error
    with pytest.raises(SystemExit) as err:
        _main(monkeypatch, "--collect", str(tmp_path / "a.pkl"), str(tmp_path / ".." /
              tmp_path.name / "a.pkl"))
    assert err.value.code == 2
    assert "the same path twice" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_fewer_than_two_updates_refused(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        _main(monkeypatch, "--collect", str(tmp_path / "a.pkl"), "--updates", "1")
    assert err.value.code == 2
    assert "--updates must be >= 2" in capsys.readouterr().err
