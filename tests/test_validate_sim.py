"""`benchmarks/validate_sim.py`: the input its command line refuses, and the points it names."""

import pickle
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


def test_the_calibration_and_repeated_points_are_points():
    labels = {p.label for p in validate_sim.POINTS}
    assert set(validate_sim.CALIBRATION) <= labels
    assert validate_sim.REPEATED in labels


def test_a_calibration_label_the_fit_run_lacks_is_refused(monkeypatch, tmp_path):
    # a misspelt label used to be dropped silently: the fit then ran on fewer points
    from weightbridge.simulation.calibrate import Run

    run = tmp_path / "run.pkl"
    run.write_bytes(pickle.dumps([Run(label="200M tiny r1", plan=None, link_rate=1.0, depth=2,
                                      spans=(), ewtt_s=(), load="")]))
    with pytest.raises(SystemExit, match=r"names \['200m tiny r1'\], not points of the fit "
                                         r"run; its points are \['200M tiny r1'\]"):
        _main(monkeypatch, "--fit-from", str(run), "--predict", str(run),
              "--calibrate", "200m tiny r1")
