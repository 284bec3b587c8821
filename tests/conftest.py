"""Shared test set-up.

Monarch child processes import actor classes by module name, and they only see PYTHONPATH, so
the test process's sys.path is exported before any mesh is spawned. A failed or stopped mesh
reports an "unhandled fault" to the root client, whose default hook exits the process (pytest
would die with KeyboardInterrupt); the hook here records it instead, and mesh tests fail on
their own assertions and errors.
"""

import fcntl
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


CLUSTER_LOCK = "/tmp/weightbridge-emulated-cluster.lock"


@pytest.fixture(autouse=True)
def _one_emulated_cluster(request):
    """A test marked ``emulated_cluster`` holds a host-wide lock while it runs: the emulated
    cluster's namespaces and bridge have fixed names (`controller.cluster`), so two of these
    tests at once (two xdist workers, or two test runs) would tear each other's hosts down."""
    if request.node.get_closest_marker("emulated_cluster") is None:
        yield
        return
    with open(CLUSTER_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        yield


def pytest_collection_modifyitems(items):
    """The long tests first (the emulated cluster's, then the other mesh and slow ones), each
    group in its own order: on xdist workers the many short tests then fill the end of the
    run, instead of one worker finishing a mesh test long after the other ran out of work."""
    def weight(item) -> int:
        for rank, mark in enumerate(("emulated_cluster", "mesh", "slow")):
            if item.get_closest_marker(mark) is not None:
                return rank
        return 3
    items.sort(key=weight)  # (stable)


def pytest_ignore_collect(collection_path, config):
    """tests/engines needs the real engines (`bash scripts/dev.sh engines`) and runs only when
    selected with ``-m engines`` (`bash scripts/dev.sh engines-test`); the default suite stays
    light and never imports them."""
    if "engines" in collection_path.parts and "engines" not in (config.option.markexpr or ""):
        return True
    return None
