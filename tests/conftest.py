"""Shared test set-up.

Monarch child processes import actor classes by module name, and they only see PYTHONPATH, so
the test process's sys.path is exported before any mesh is spawned. A failed or stopped mesh
reports an "unhandled fault" to the root client, whose default hook exits the process (pytest
would die with KeyboardInterrupt); the hook here records it instead, and mesh tests fail on
their own assertions and errors.
"""

import os
import sys

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

import monarch.actor  # noqa: E402  (after PYTHONPATH: children inherit the environment)

MESH_FAULTS: list[str] = []
monarch.actor.unhandled_fault_hook = lambda failure: MESH_FAULTS.append(str(failure))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _mesh_faults(request):
    """The mesh faults a test caused, as a section of its report (shown when it fails): a
    test that kills a proc expects some; one that fails for no reason of its own shows why."""
    del MESH_FAULTS[:]
    yield
    if MESH_FAULTS:
        request.node.add_report_section("call", "mesh faults", "\n".join(MESH_FAULTS))


def pytest_ignore_collect(collection_path, config):
    """tests/engines needs the real engines (`bash scripts/dev.sh engines`) and runs only when
    selected with ``-m engines`` (`bash scripts/dev.sh engines-test`); the default suite stays
    light and never imports them."""
    if "engines" in collection_path.parts and "engines" not in (config.option.markexpr or ""):
        return True
    return None
