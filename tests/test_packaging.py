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


def test_every_package_folder_is_listed_in_pyproject():
    """A subpackage missing from [tool.setuptools] packages works in the editable install but
    is left out of a wheel (it happened to weightbridge.types)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for top in ("weightbridge", "kernels", "meshes", "controller")
             for p in (REPO / top).rglob("__init__.py")}
    assert found == listed, (f"in the tree, not in pyproject.toml: {sorted(found - listed)}; "
                             f"listed, not in the tree: {sorted(listed - found)}")
