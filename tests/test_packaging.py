"""The import names are taken on PyPI by unrelated packages: make sure ours are the ones loaded."""

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["weightbridge", "kernels", "meshes", "controller"])
def test_package_resolves_to_this_repo(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(REPO / name), (
        f"`import {name}` loaded {module.__file__}, not this repo's {name}/: an unrelated PyPI "
        f"package of that name shadows it; uninstall it or reinstall with `pip install -e .`")
