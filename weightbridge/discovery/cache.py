"""Source maps kept across restarts, keyed by what decides them and never trusted unverified.

A worker's map is decided by the checkpoint it reads, its parameters and its loader. Restarts
of a job rarely change any of them, so connect keeps each worker's map in a small JSON file
(a few KiB) under a directory (`TransferConfig.source_map_cache`), named by a digest of:

- the worker (side and rank: TP ranks share shapes and code, not maps),
- the checkpoint spec (names, shapes, dtypes),
- the parameters (names, shapes, dtypes, strides),
- the loader's fingerprint (`loader_fingerprint`: its code and its plain settings).

A later connect with the same key loads the map and runs the probe's verification pass alone
(`probe.reverify`): one load of a pseudo-random checkpoint, compared with what the map
predicts. A loader that changed in a way the key does not see (a library it calls, a tensor it
holds) fails it, and the worker probes afresh and replaces the entry. Files are JSON of ints
and strs (never unpickled: a shared directory cannot run code here) and written atomically.

At connect every worker of a group takes the same way (`session.source_maps`): kept maps are
verified only if every worker holds one, and probed everywhere if any verification fails, so a
collective loader (a DCP load over the trainers, vLLM's over an engine's TP ranks) sees the same
number of loads on every rank.

Typical usage (one worker on its own)::

    cache = SourceMapCache("~/.cache/weightbridge/source-maps")
    smap, reused = probe_cached(params, load_weights, spec, cache=cache, worker="rollout 3")
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch

from weightbridge.discovery.probe import LoadWeights, Probed, probe, reverify
from weightbridge.errors import warn_once
from weightbridge.types import CheckpointSpec, ParamSpec, Piece, Region, SourceMap

FORMAT = 1
"""Bumped whenever the entry format or what a map means changes: older entries are misses."""
_PLAIN = (int, float, str, bool, type(None))
_MAX_DEPTH = 3
"""How deep `loader_fingerprint` follows functions held by a loader's closure or object."""


class SourceMapCacheWarning(UserWarning):
    """The cache directory could not be written: connect goes on, probing every time."""


class SourceMapCache:
    """A directory of source maps, one JSON file per key (module docstring)."""

    def __init__(self, directory: str):
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"the source map cache must be a directory path, got "
                             f"{directory!r}")
        self.directory = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> Probed | None:
        """The entry of ``key``, or None (none, unreadable, or of another format)."""
        try:
            entry = json.loads(self.path(key).read_text())
            if entry.get("format") != FORMAT or entry.get("key") != key:
                return None
            return _decode(entry)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, key: str, probed: Probed) -> None:
        """Write the entry atomically (a reader sees the old file or the new one); a directory
        that cannot be written is warned about once and skipped."""
        entry = {"format": FORMAT, "key": key, **_encode(probed)}
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f, separators=(",", ":"))
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):  # (a full disk: no half-written file left behind)
                    os.unlink(tmp)
        except OSError as e:
            warn_once((SourceMapCacheWarning, str(self.directory)),
                      f"cannot write the source map cache at {self.directory} ({e}); connect "
                      f"goes on without it and probes every time. Set TransferConfig("
                      f"source_map_cache=...) to a writable directory, or None to turn the "
                      f"cache off", SourceMapCacheWarning, stacklevel=3)


def verified_map(cache: SourceMapCache, key: str, params: Mapping[str, torch.Tensor],
                 load_weights: LoadWeights, spec: CheckpointSpec) -> SourceMap | None:
    """The map kept under ``key`` if the verification pass alone confirms it on the live
    loader (one load), else None (none kept, or the loader does something else now)."""
    found = cache.load(key)
    if found is None or not reverify(found, params, load_weights, spec):
        return None
    return found.source_map


def probe_and_keep(cache: SourceMapCache | None, key: str | None,
                   params: Mapping[str, torch.Tensor], load_weights: LoadWeights,
                   spec: CheckpointSpec) -> SourceMap:
    """Probe, and keep the map under ``key`` (no cache: only probe)."""
    probed = probe(params, load_weights, spec)
    if cache is not None:
        cache.save(key, probed)
    return probed.source_map


def probe_cached(params: Mapping[str, torch.Tensor], load_weights: LoadWeights,
                 spec: CheckpointSpec, *, cache: SourceMapCache | None, worker: str
                 ) -> tuple[SourceMap, bool]:
    """One worker on its own: its map and whether it came from ``cache`` (verified) rather
    than a probe. (A group decides for all its workers at once, so that a collective loader
    sees the same loads on every rank: `weightbridge.coordination.session.source_maps`.)

    Raises what the probe raises (`LayoutError`, ``ValueError``): a cached map that fails
    verification is dropped and the loader probed afresh, so its errors are the probe's.
    """
    key = None if cache is None else cache_key(worker, params, load_weights, spec)
    smap = None if cache is None else verified_map(cache, key, params, load_weights, spec)
    if smap is not None:
        return smap, True
    return probe_and_keep(cache, key, params, load_weights, spec), False


def cache_key(worker: str, params: Mapping[str, torch.Tensor], load_weights: LoadWeights,
              spec: CheckpointSpec) -> str:
    """A hex digest of what decides a worker's map (module docstring)."""
    described = (FORMAT, worker,
                 [(t.name, t.shape, t.dtype) for t in spec.tensors],
                 [(n, tuple(p.shape), str(p.dtype), tuple(p.stride()))
                  for n, p in sorted(dict(params).items())],
                 loader_fingerprint(load_weights))
    return hashlib.sha256(repr(described).encode()).hexdigest()[:32]


def loader_fingerprint(load_weights: Callable, depth: int = 0) -> str:
    """What tells one loader from another without running it: the qualified names and code
    (bytecode, constants, names; nested functions' too) of the function, of a bound method's
    class or a callable object's ``__call__``, and the plain values (ints, floats, strs, bools,
    None, tuples of them) in its closure, its object's attributes and a ``functools.partial``'s
    arguments; functions held there are followed a few levels. Tensors and other state are not
    in it: the verification pass decides whether a cached map still holds. A plain attribute
    that changes as the loader runs (a load counter) changes the key; connect computes keys
    before any load, so a restart, built afresh, finds its entry."""
    parts: list = []
    fn, owner = load_weights, None
    if isinstance(fn, functools.partial):
        parts.append(("partial", _plain(fn.args), _plain(sorted(fn.keywords.items()))))
        fn = fn.func
    if inspect.ismethod(fn):
        fn, owner = fn.__func__, fn.__self__
    elif not inspect.isfunction(fn) and callable(fn):
        fn, owner = type(fn).__call__, fn
    if owner is not None:
        parts.append((type(owner).__qualname__, _held(vars(owner) if hasattr(owner, "__dict__")
                                                      else {}, depth)))
    code = getattr(fn, "__code__", None)
    parts.append((getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(type(fn))),
                  _code(code) if code is not None else None))
    cells = getattr(fn, "__closure__", None) or ()
    parts.append(_held({name: _cell(c) for name, c in zip(code.co_freevars, cells)}
                       if code is not None else {}, depth))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _code(code) -> tuple:
    consts = tuple(_code(c) if inspect.iscode(c) else _plain(c) for c in code.co_consts)
    return code.co_code.hex(), consts, code.co_names


def _held(values: dict, depth: int) -> list:
    out = []
    for name, value in sorted(values.items()):
        if callable(value) and not isinstance(value, type) and depth < _MAX_DEPTH:
            out.append((name, loader_fingerprint(value, depth + 1)))
        elif _plain(value) is not None or value is None:
            out.append((name, _plain(value)))
    return out


def _plain(value):
    """``value`` if it is plain (recursively for tuples and lists), else None."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    return None


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return None


# --------------------------------------------------------------------------------------------
# Entries: JSON of ints and strs
# --------------------------------------------------------------------------------------------


def _encode(probed: Probed) -> dict:
    smap = probed.source_map
    return {"params": [[p.name, list(p.shape), p.dtype] for p in smap.params],
            "pieces": [[p.region.tensor, p.region.start, p.region.count, p.region.step,
                        p.param, p.offset, p.strides, p.cast_from, p.block]
                       for p in smap.pieces],
            "unsourced": smap.unsourced, "unused": smap.unused, "holes": probed.holes}


def _decode(entry: dict) -> Probed:
    pieces = tuple(Piece(Region(t, tuple(start), tuple(count), tuple(step)), param, offset,
                         tuple(strides), cast_from, tuple(block))
                   for t, start, count, step, param, offset, strides, cast_from, block
                   in entry["pieces"])
    smap = SourceMap(tuple(ParamSpec(n, tuple(shape), dtype) for n, shape, dtype
                           in entry["params"]), pieces,
                     tuple((n, int(k)) for n, k in entry["unsourced"]),
                     tuple(entry["unused"]))
    holes = tuple((name, tuple((int(a), int(b)) for a, b in ranges))
                  for name, ranges in entry["holes"])
    return Probed(smap, holes)

