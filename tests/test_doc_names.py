"""The docs name only methods and attributes that exist (issue 24: README named
``add_engine`` for running groups, where the adapters have ``add_engines``).

Every ``Class.name`` of our public classes in README.md and docs/*.md, and every
``var.name`` of the variable names the docs use for them (``group.``, ``sender.``, ``mt.``,
...), must be an attribute of the class or one its methods set on ``self``.
"""

import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_ATTRIBUTES = {"py", "md", "json"}
"""``config.py``, ``sender.py``: file names, not attributes."""


def _classes() -> dict:
    from controller.driver import MeshTransfer
    from controller.report import JoinReport, UpdateReport
    from weightbridge import (CheckpointSpec, Cluster, Placement, ReceiverAdapter, SenderAdapter,
                              SourceMap, TransferConfig, TransferPlan, WorkerParts, WorkersLost)
    from weightbridge.driver import (GroupLeader, LocalControl, MeshControl, RolloutSpec,
                                     TrainerSpec, TransferGroup, TransferWorker)

    by_name = {c.__name__: c for c in (
        MeshTransfer, JoinReport, UpdateReport, CheckpointSpec, Cluster, Placement,
        ReceiverAdapter, SenderAdapter, SourceMap, TransferConfig, TransferPlan, WorkerParts,
        WorkersLost, GroupLeader, LocalControl, MeshControl, RolloutSpec, TrainerSpec,
        TransferGroup, TransferWorker)}
    by_variable = {"group": TransferGroup, "sender": SenderAdapter, "receiver": ReceiverAdapter,
                   "mt": MeshTransfer, "plan": TransferPlan, "config": TransferConfig}
    return by_name, by_variable


def _has(cls, name: str) -> bool:
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in cls.__mro__:  # instance attributes: set on self in some method
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\b\s*(:[^=\n]*)?=[^=]|\bself\.{name}\s*,|"
                     rf",\s*self\.{name}\b[^\n]*=", source):
            return True
    return False


def _mentions() -> list[tuple[str, str, str]]:
    """(doc:line, owner as written, attribute) of every candidate mention."""
    by_name, by_variable = _classes()
    owners = "|".join(sorted(set(by_name) | set(by_variable), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.])({owners})\.([A-Za-z_]\w*)")
    out = []
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for owner, attr in pattern.findall(line):
                if attr not in NOT_ATTRIBUTES:
                    out.append((f"{path.relative_to(REPO)}:{i}", owner, attr))
    return out


@pytest.mark.mesh  # imports Monarch (controller.driver, weightbridge.mesh): spawns nothing
def test_every_method_the_docs_name_exists():
    by_name, by_variable = _classes()
    mentions = _mentions()
    assert len(mentions) > 50  # the pattern finds them (guards against a vacuous pass)
    missing = [f"{where}: {owner}.{attr}" for where, owner, attr in mentions
               if not _has(by_name.get(owner) or by_variable[owner], attr)]
    assert not missing, missing


def test_the_check_catches_a_method_that_does_not_exist():
    from weightbridge import SenderAdapter, TransferConfig

    assert _has(SenderAdapter, "add_engines") and not _has(SenderAdapter, "add_engine")
    assert _has(TransferConfig, "wait_s") and _has(TransferConfig, "round_bytes")
