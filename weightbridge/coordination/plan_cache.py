"""Plans kept across restarts: the controller's share of a restart's connect.

After the maps arrive, connect plans (`plan_transfer`), builds every worker's plan and pickles
each for its worker. At the paper's largest deployment (Kimi-K2, 512 workers) that is 4-5 s,
4-5 s and 3-4 s on this machine's controller, and a restart of the same job plans the same maps
again. Connect keeps what planning produced (`Planned`) in one file per key under
`TransferConfig.plan_cache`, on the host where connect runs, named by a digest of everything
that decides it:

- every worker's source map and placement, as gathered (kept maps are verified before they
  are gathered: the key holds only maps the live loaders confirmed),
- the round size and the depth,
- the library's own code (every source file of `weightbridge`): a changed planner finds no
  entry, never a stale plan.

A later connect with the same key reads the entry instead of planning (`kept_or_planned`).
Entries are pickled, and read back only from a file this user owns in a directory no one else
can write, with only the plan's own classes and numpy's arrays allowed in them: another user's
file could otherwise run code here. Each entry is written atomically, and only the `KEEP` most
recently used stay (Kimi-K2's is about 200 MiB).

Typical usage (`session.plan_group` does this at connect)::

    planned, kept = kept_or_planned(PlanCache(config.plan_cache), trainer_maps, rollout_maps,
                                    round_bytes=config.round_bytes, depth=config.depth)
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from weightbridge.coordination.sequencer import active_steps
from weightbridge.errors import warn_once
from weightbridge.execution.executor import incoming_ranges, outgoing_ranges
from weightbridge.planning.plan import TransferPlan, plan_transfer
from weightbridge.types import Placement, Range, SourceMap, WorkerId

FORMAT = 1
"""Bumped whenever `Planned` changes shape: older entries are misses."""
KEEP = 3
"""Entries kept in the directory; saving a fourth removes the least recently used."""
_SUFFIX = ".plan"
_NUMPY = {("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy._core.numeric", "_frombuffer"), ("numpy.core.multiarray", "_reconstruct"),
          ("numpy.core.numeric", "_frombuffer"), ("numpy", "ndarray")}
"""The globals a plan's numpy tables pickle to (beside WeightBridge's own classes)."""
_PLANNER = ("weightbridge.planning.", "weightbridge.types.")

Maps = Sequence[tuple[SourceMap, Placement]]


class PlanCacheWarning(UserWarning):
    """The plan cache could not be written, or an entry was not read (not this user's):
    connect goes on, planning."""


@dataclass(frozen=True, slots=True)
class Planned:
    """What connect hands out and keeps of a plan, before any worker is set up."""

    plan: TransferPlan
    handed: Mapping[WorkerId, bytes]
    """Every worker's `WorkerPlan`, pickled once (what `PeerCall.SETUP` carries)."""
    ranges: Mapping[WorkerId, tuple[Range, ...]]
    """Per receiver, the ranges of its round buffers peers write into (sorted)."""
    outgoing: Mapping[WorkerId, frozenset]
    """Per worker, the (peer, range) of each of its writes: the handles it needs."""
    active: frozenset
    """The steps some worker takes part in (`active_steps`)."""


def plan_of(trainers: Maps, rollouts: Maps, *, round_bytes: int, depth: int,
            reroute: Callable[[TransferPlan], TransferPlan] | None = None) -> Planned:
    """Plan from the maps: `plan_transfer`, ``reroute`` (if any), every worker's plan."""
    plan = plan_transfer(trainers, rollouts, round_bytes=round_bytes)
    if reroute is not None:
        plan = reroute(plan)
    plans = plan.worker_plans()
    return Planned(plan=plan,
                   handed={w: pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
                           for w, p in plans.items()},
                   ranges={w: tuple(sorted(r))
                           for w, r in incoming_ranges(plans.values(), depth).items()},
                   outgoing={w: frozenset(outgoing_ranges(p, depth)) for w, p in plans.items()},
                   active=active_steps(plans.values()))


def kept_or_planned(cache: PlanCache, trainers: Maps, rollouts: Maps, *, round_bytes: int,
                    depth: int) -> tuple[Planned, bool]:
    """The entry ``cache`` keeps for these maps and settings, else a fresh plan (kept); and
    whether it was kept."""
    key = plan_key(trainers, rollouts, round_bytes=round_bytes, depth=depth)
    found = cache.load(key)
    if found is not None:
        return found, True
    planned = plan_of(trainers, rollouts, round_bytes=round_bytes, depth=depth)
    cache.save(key, planned)
    return planned, False


def plan_key(trainers: Maps, rollouts: Maps, *, round_bytes: int, depth: int) -> str:
    """A hex digest of what decides a plan (module docstring). The maps are pickled without
    the pickler's memo, so that equal maps give equal bytes however their strings are shared
    (a map probed afresh and one read back from the source map cache)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True  # (no memo: values, not object identity; maps hold no cycles)
    pickler.dump((tuple(trainers), tuple(rollouts)))
    digest = hashlib.sha256(repr((FORMAT, planner_code(), round_bytes, depth)).encode())
    digest.update(out.getbuffer())
    return digest.hexdigest()[:32]


@functools.cache
def planner_code() -> str:
    """A digest of the library's sources: the planner, what it builds on (`correspond`, the
    types) and what connect derives from its plans. All of them, rather than a list that
    could miss one: a restart runs the code it ran before, and a miss only plans again."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


class PlanCache:
    """A directory of `Planned` entries, one file per key (module docstring)."""

    def __init__(self, directory: str):
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"the plan cache must be a directory path, got {directory!r}")
        self.directory = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def load(self, key: str) -> Planned | None:
        """The entry of ``key``, or None (none, unreadable, of another format, or in a file
        or directory another user could have written: warned about)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                why = _not_ours(os.fstat(f.fileno()), os.stat(self.directory))
                if why:
                    _warn(self.directory, "not ours", f"{path} not read: {why}")
                    return None
                entry = _Unpickler(f).load()
        except FileNotFoundError:
            return None
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError,
                TypeError, ValueError):
            return None
        if not (isinstance(entry, tuple) and len(entry) == 3 and entry[:2] == (FORMAT, key)
                and isinstance(entry[2], Planned)):
            return None
        try:
            os.utime(path)  # (used now: the eviction keeps the most recently used)
        except OSError:
            pass
        return entry[2]

    def save(self, key: str, planned: Planned) -> None:
        """Write the entry atomically (a reader sees no file or the whole one), then drop all
        but the `KEEP` most recently written or read; a directory that cannot be written is
        warned about once and skipped."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((FORMAT, key, planned), f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):  # (a full disk: no half-written file left behind)
                    os.unlink(tmp)
        except OSError as e:
            _warn(self.directory, "unwritable", f"cannot write it ({e})")
            return
        self._evict()

    def _evict(self) -> None:
        entries = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                entries.append((path.stat().st_mtime_ns, path))
            except OSError:  # (removed meanwhile by another connect's eviction)
                continue
        for _, path in sorted(entries, reverse=True)[KEEP:]:
            try:
                path.unlink()
            except OSError:
                pass


def _not_ours(entry: os.stat_result, directory: os.stat_result) -> str | None:
    """Why an entry may not be unpickled, or None: file and directory must be this user's and
    writable by no one else."""
    uid = os.getuid()
    for what, st in (("the file", entry), ("its directory", directory)):
        if st.st_uid != uid:
            return f"{what} belongs to uid {st.st_uid}, not to this user ({uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{what} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


class _Unpickler(pickle.Unpickler):
    """Builds `Planned`, the plan's own types (classes and the functions that rebuild them,
    defined in `weightbridge.planning` and `weightbridge.types`) and numpy's arrays, nothing
    else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _NUMPY or (module, name) == (__name__, "Planned"):
            return super().find_class(module, name)
        if module.startswith(_PLANNER) and "." not in name:
            found = super().find_class(module, name)
            if getattr(found, "__module__", None) == module:  # (not something it imported)
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a plan cache entry")


def _warn(directory: Path, what: str, why: str) -> None:
    warn_once((PlanCacheWarning, str(directory), what),
              f"plan cache at {directory}: {why}; connect goes on, planning afresh. Set "
              f"TransferConfig(plan_cache=...) to a directory of your own (mode 700), or None "
              f"to turn the cache off", PlanCacheWarning, stacklevel=4)
