"""The docs name only methods and attributes that exist (issue 24: README named
``add_engine`` for running groups, where the adapters have ``add_engines``).

Every ``Class.name`` of our public classes in README.md and docs/*.md, and every
``var.name`` of the variable names the docs use for them (``group.``, ``sender.``, ``mt.``,
...), must be an attribute of the class or one its methods set on ``self``.
"""

import importlib
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


# -- module paths, file paths and cited sections ---------------------------------------------

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The pages a reader follows. The lab logs under docs/notes/ are dated records, kept as they
were written: their references are checked only where they link to a page (`LINKS`)."""
NOTES = sorted((REPO / "docs" / "notes").glob("*.md"))
SOURCES = sorted(p for top in ("weightbridge", "controller", "meshes", "kernels", "benchmarks",
                               "examples", "tests", "scripts")
                 for p in (REPO / top).rglob("*.py") if p != Path(__file__).resolve())
"""Code whose docstrings and comments cite doc sections (``docs/x.md, "Title"``)."""
PACKAGES = ("weightbridge", "controller", "meshes", "kernels")
TOP_DIRS = ("benchmarks", "docs", "tests", "examples", "weightbridge", "controller", "meshes",
            "kernels", "scripts", "requirements")
NOT_REPO_FILES = {"kernels/linear/scaled_mm/cpu.py": "vLLM's file (docs/layout.md, FP8 on CPU)"}
"""Paths the docs cite that are not files of this repo, and why."""
MODULE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*\w)")
BARE_MD = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")
CITED = re.compile(r"((?:docs/)?(?:notes/)?[\w-]+\.md)\)?,?\s+\(?\"([^\"]+)\"")
NUMBERED = re.compile(r"((?:docs/)?[\w-]+\.md),?\s+sections?\s+(\d+)")
"""``integration.md, section 7``: the page must have a heading numbered 7."""


def _text(path: Path) -> str:
    return path.read_text()


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _headings(path: Path) -> list[str]:
    """A page's headings, outside code fences, whitespace collapsed."""
    out, fenced = [], False
    for line in _text(path).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(" ".join(line.lstrip("#").split()))
    return out


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _names_heading(title: str, headings: list[str]) -> bool:
    """A cited title names a heading: the whole heading, or its start up to a qualifier
    (``"Round size"`` for ``## Round size``; ``"Layout discovery at scale"`` for ``## Layout
    discovery at scale (`bench_probe.py --sweep`)``; ``"Delta updates"`` for ``## Delta
    updates: ...``)."""
    title = " ".join(title.split())
    return any(h == title or any(h.startswith(title + sep) for sep in (" (", ":", ","))
               for h in headings)


def _resolve_doc(name: str, where: Path) -> Path | None:
    for base in (where.parent, REPO, REPO / "docs"):
        if (base / name).is_file():
            return (base / name).resolve()
    return None


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] in NOT_ATTRIBUTES:  # `controller.py`, a file name
        return True
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _assigned_in_code(text: str, pos: int, name: str) -> bool:
    """Whether ``pos`` lies in a code fence that binds ``name`` (``kernels = ...``: a local
    variable that shadows the package)."""
    start = text.rfind("```", 0, pos)
    if start < 0 or text.count("```", 0, pos) % 2 == 0:
        return False
    end = text.find("```", pos)
    return re.search(rf"^\s*{name}\s*=", text[start:end], re.M) is not None


def module_mentions() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(REPO)}:{_line(t, m.start())}", m.group(1))
            for p in PAGES for t in [_text(p)] for m in MODULE.finditer(t)
            if not _assigned_in_code(t, m.start(), m.group(1).split(".")[0])]


def path_mentions() -> list[tuple[str, str, bool]]:
    """(where, path as cited, whether it exists) of every repo path and page name cited."""
    out = []
    for p in PAGES:
        t = _text(p)
        for m in PATH.finditer(t):
            cited = m.group(1)
            exists = (REPO / cited).exists() or cited in NOT_REPO_FILES
            out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", cited, exists))
        for m in BARE_MD.finditer(t):
            out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", m.group(1),
                        _resolve_doc(m.group(1), p) is not None))
    for p in SOURCES:
        t = _text(p)
        for m in re.finditer(r"(?<![\w./-])(docs/[\w./-]*\.md)", t):
            out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", m.group(1),
                        (REPO / m.group(1)).is_file()))
    return out


def section_mentions() -> list[tuple[str, str, str, bool]]:
    """(where, page, title or anchor, whether the page has that heading) of every cited
    section: markdown links with an anchor, and ``page.md, "Title"`` in pages and code."""
    out = []
    for p in PAGES + NOTES:
        t = _text(p)
        for m in LINK.finditer(t):
            target, anchor = m.group(1), m.group(2)
            if target.startswith(("http:", "https:")) or (not target and not anchor):
                continue
            page = (p.parent / target).resolve() if target else p
            if not page.is_file():
                out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", target, "", False))
            elif anchor:
                out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", target, anchor,
                            anchor in {_anchor(h) for h in _headings(page)}))
    for p in PAGES + SOURCES:
        t = _text(p)
        for m in CITED.finditer(t):
            page = _resolve_doc(m.group(1), p)
            ok = page is not None and _names_heading(m.group(2), _headings(page))
            out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", m.group(1),
                        m.group(2), ok))
        for m in NUMBERED.finditer(t):
            page = _resolve_doc(m.group(1), p)
            ok = page is not None and any(h.startswith(f"{m.group(2)}. ")
                                          for h in _headings(page))
            out.append((f"{p.relative_to(REPO)}:{_line(t, m.start())}", m.group(1),
                        f"section {m.group(2)}", ok))
    return out


@pytest.mark.mesh  # resolving `controller.driver` and `weightbridge.mesh` imports Monarch
def test_every_module_path_the_docs_name_resolves():
    mentions = module_mentions()
    assert len(mentions) > 50, len(mentions)  # the pattern finds them
    missing = [f"{where}: {dotted}" for where, dotted in mentions if not _resolves(dotted)]
    assert not missing, missing


def test_every_file_the_docs_cite_exists():
    mentions = path_mentions()
    assert len(mentions) > 50, len(mentions)
    missing = [f"{where}: {cited}" for where, cited, exists in mentions if not exists]
    assert not missing, missing


def test_every_section_the_docs_cite_exists():
    mentions = section_mentions()
    assert len(mentions) > 20, len(mentions)
    missing = [f"{where}: {page} {title!r}" for where, page, title, ok in mentions if not ok]
    assert not missing, missing


def test_the_checks_catch_what_does_not_exist(tmp_path):
    assert _resolves("weightbridge.coordination.session.connect_group")
    assert _resolves("controller.MeshTransfer")
    assert not _resolves("weightbridge.coordination.session.no_such_function")
    assert not _resolves("weightbridge.no_such_module")
    assert _names_heading("Round size", ["Round size"])
    assert _names_heading("Layout discovery at scale",
                          ["Layout discovery at scale (`bench_probe.py --sweep`)"])
    assert not _names_heading("Round", ["Round size"])
    page = tmp_path / "page.md"
    page.write_text("# T\n\n## Round size\n\n```\n## not a heading\n```\n")
    assert _headings(page) == ["T", "Round size"]
    assert _anchor("Delta updates: `send_weights(v, changed=...)`") == \
        "delta-updates-send_weightsv-changed"
