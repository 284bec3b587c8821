"""A protocol fuzz of the adapters in one process: updates, deltas, joins, leaves, kills and
stalls in every sync mode, with the version protocol's promises checked after every poll.

Each seed is a `fuzz_plan.Scenario` (tests/fuzz_plan.py) run on a `LocalControl`: every
rollout rank polls on a thread of its own (the ranks of an engine in lockstep, as an engine's
collectives keep them), the script runs the scenario's operations on the trainers, then sends
full updates until one goes through and lets every rank poll until it holds that version or
is told it is out. What is checked (the kinds of `Violation`):

    torn         a poll returned and the parameters are not the bytes of the version the rank
                 then holds (``receiver.version``), bit for bit
    outside      the parameters changed between two polls of the rank (bytes enter only
                 inside a poll)
    decrease     a rank's version went down, or a poll returned another version than it holds
    mixed        ranks of one engine held different versions after the same step
    untold       a rank that is out (its engine removed, lost a worker, was excluded, or the
                 group ended) did not raise `TransferFailed` by the end; or polled normally
                 again after it did
    not_at_last  a live rank that was never told did not end on the last version sent
    wedged       no final full update went through (three tries, every fault over) though
                 trainer 0 lives and the group was not closed
    error        a poll or a trainer call raised something the documentation does not list
    hang         a trainer call did not return within its bound (the seed stops there)
    stale        a trainer's send_weights after it rebound a parameter's storage did not
                 raise `ParameterRebound` (the registered storage's old bytes would go out)

Typical usage::

    result = run_seed(7)
    for v in result.violations:
        print(v.kind, v.detail)

`benchmarks/fuzz_protocol.py` runs many seeds; `tests/test_protocol_fuzz.py` a few.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import torch

from weightbridge.config import TransferConfig
from weightbridge.errors import TransferFailed
from weightbridge.coordination.local_control import LocalControl
from weightbridge.adapters.receiver import ReceiverAdapter
from weightbridge.adapters.sender import SenderAdapter
from weightbridge.errors import ParameterRebound
from fuzz_plan import (SHAPES, Model, Op, Scenario, same_bytes,
                                             scenario_of, value)
from weightbridge.types import CheckpointSpec, WorkerId

KINDS = ("torn", "outside", "decrease", "mixed", "untold", "not_at_last", "wedged", "error",
         "hang", "stale")
SPEC = CheckpointSpec.from_tensors({n: value(n, 0) for n in SHAPES})
_TOLERATED = (TransferFailed, TimeoutError)
_TOLD_POLLS = 3
"""Polls a told rank makes before it stops (each must raise `TransferFailed` again)."""


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    """One of `KINDS`."""
    detail: str


@dataclass(frozen=True, slots=True)
class Result:
    scenario: Scenario
    violations: tuple[Violation, ...]
    last: int | None
    """The version every live rank must end on (None: no final update went through)."""
    trainer_errors: tuple[str, ...]
    """What the trainers' calls raised (documented failures: not violations)."""
    wall_s: float


def run_seed(seed: int, **kwargs) -> Result:
    """Run the scenario of ``seed`` (`scenario_of`'s keyword arguments pass through)."""
    return run(scenario_of(seed, **kwargs))


def run(scenario: Scenario) -> Result:
    t0 = time.monotonic()
    fuzz = _Fuzz(scenario)
    try:
        last = fuzz.script()
    finally:
        fuzz.finish()
    return Result(scenario, tuple(fuzz.violations), last, tuple(fuzz.trainer_errors),
                  time.monotonic() - t0)


class _Rank:
    """A rollout rank: its model, receiver, and what the fuzz saw of it."""

    def __init__(self, model: Model, receiver: ReceiverAdapter):
        self.model, self.receiver = model, receiver
        self.snapshot = {n: p.clone() for n, p in model.params.items()}
        self.dead = False
        self.told: str | None = None
        self.told_polls = 0
        self.seen = 0  # newest version seen
        self.history: list[int | None] = []  # version after each poll (None: it raised)
        self.synced = True  # still in lockstep with its engine
        self.thread: threading.Thread | None = None
        self.joined = False  # added by a join (not at connect)


class _Fuzz:
    def __init__(self, s: Scenario):
        self.s = s
        self.rng = random.Random(s.seed * 7919 + 1)
        ss, rs = s.staging
        self.config = TransferConfig(timeout_s=s.timeout_s, sender_staging=ss,
                                     receiver_staging=rs, round_control=s.round_control)
        self.bound = 12 * s.timeout_s + 10  # a trainer call that takes longer: a hang
        self.control = LocalControl()
        self.trainers: list[tuple[Model, SenderAdapter]] = []
        for i in range(s.num_trainers):
            m = Model()
            self.trainers.append((m, self.control.add(SenderAdapter(
                m.params, m.load_weights, SPEC, rank=i, control=self.control,
                transport=self.control.transport, config=self.config))))
        self.live_trainers = list(range(s.num_trainers))
        self.ranks: list[_Rank] = []
        self.barriers: dict[int, threading.Barrier] = {}
        self.paused_until: dict[int, float] = {}
        self.out_engines: dict[int, str] = {}  # engine -> why the fuzz knows it is out
        self.held = dict.fromkeys(SHAPES, 0)  # tensor -> the version of its value
        self.truth: dict[int, dict[str, int]] = {0: dict(self.held)}
        self.cache: dict[tuple[str, int], torch.Tensor] = {}
        self.version = 0
        self.violations: list[Violation] = []
        self.seen_keys: set[tuple[str, str]] = set()
        self.trainer_errors: list[str] = []
        self.timers: list[threading.Thread] = []
        self.stop = threading.Event()
        self.ended = False  # trainer 0 died
        self.lock = threading.Lock()
        for e in range(s.num_engines):
            self._add_engine(e)

    # -- the script ----------------------------------------------------------------------------

    def script(self) -> int | None:
        if not self._collective("connect", lambda a: a.connect()):
            return None
        for rank in self.ranks:  # connect probed them: they hold probe values until v1
            rank.snapshot = {n: p.clone() for n, p in rank.model.params.items()}
            self._start(rank)
        for op in self.s.ops:
            if self.ended or not self._run_op(op):
                break
            time.sleep(self.rng.choice((0.0, 0.002, 0.01)))
        for t in self.timers:  # every fault has started and ended
            t.join()
        last = None
        if not self.ended and not self._hung():
            for _ in range(3):
                if self._update(None, final=True):
                    last = self.version
                    break
        self._settle(last)
        return last

    def _run_op(self, op: Op) -> bool:
        if op.kind == "update":
            self._update(op.changed)
            return not self._hung()
        if op.kind == "join":
            if self.config.sender_staging:
                # A `LocalControl` grows as receivers are added, under a transfer that may be
                # waiting for its rollouts (meshes grow only at add_engines): add them
                # between transfers.
                self._collective("wait_idle", lambda a: a.wait_idle() if a.worker.index == 0
                                 else None)
            first = len(self.ranks)
            engine = first // self.s.engine_size
            self._add_engine(engine)
            for rank in self.ranks[first:]:
                rank.joined = True
                self._start(rank)
            self._collective("add_engines", lambda a: a.add_engines())
            return not self._hung()
        if op.kind == "rebind":
            self._rebind()
            return not self._hung()
        if op.kind == "leave":
            done = self._collective(f"remove_engine({op.engine})",
                                    lambda a: a.remove_engine(op.engine))
            if done:
                self.out_engines.setdefault(op.engine, f"removed (remove_engine({op.engine}))")
            return not self._hung()
        self._later(op)
        return True

    def _later(self, op: Op) -> None:
        """Start a fault ``op.delay_s`` from now, on a thread of its own."""
        def fault():
            time.sleep(op.delay_s)
            if op.kind == "kill" and op.side == "trainer":
                self.control.kill(WorkerId("trainer", op.worker))
                with self.lock:
                    self.live_trainers = [i for i in self.live_trainers if i != op.worker]
                    self.ended = self.ended or op.worker == 0
            elif op.kind == "kill":
                rank = self.ranks[op.worker]
                rank.dead = True
                self.control.kill(rank.receiver.worker)
                e = op.worker // self.s.engine_size
                self.out_engines.setdefault(e, f"lost worker R{op.worker}")
                self.barriers[e].abort()
            elif op.kind == "stall":
                w = WorkerId("rollout", op.worker)
                self.control.stall(w)
                time.sleep(op.seconds)
                self.control.resume(w)
            else:
                self.paused_until[op.engine] = time.monotonic() + op.seconds
                time.sleep(op.seconds)
        t = threading.Thread(target=fault, daemon=True, name=f"fuzz-{op.kind}")
        self.timers.append(t)
        t.start()

    def _update(self, changed, *, final: bool = False) -> bool:
        """One step and send_weights on every live trainer; True if every one returned."""
        self.version += 1
        v = self.version
        names = sorted(SHAPES) if changed is None else list(changed)
        for n in names:
            self.held[n] = v
        self.truth[v] = dict(self.held)
        for m, _ in self.trainers:  # (a dead trainer's parameters no longer matter)
            m.load_weights((n, self._value(n, v)) for n in names)
        ss = self.config.sender_staging

        def send(a: SenderAdapter):
            a.send_weights(v, changed=None if changed is None else list(changed))
            if ss and final and a.worker.index == 0:
                a.wait_idle()
        return self._collective(f"send_weights({v}, changed={changed})", send)

    def _rebind(self) -> None:
        """A train step that rebinds one tensor's storage (new values in new storage) on
        every live trainer: each send_weights must raise `ParameterRebound`. Then the values
        go into the registered storage (the documented fix) and a full update follows."""
        name = sorted(SHAPES)[self.version % len(SHAPES)]
        self.version += 1
        v = self.version
        self.held[name] = v
        self.truth[v] = dict(self.held)  # (what the rollouts must hold if it went out)
        registered = {}
        for i in self.live_trainers:
            p = self.trainers[i][0].params[name]
            registered[i] = p.data
            p.data = self._value(name, v).clone()
        out = self._call_all(f"send_weights({v}) after a rebind", lambda a: a.send_weights(v))
        for i, e in (out or {}).items():
            if not isinstance(e, ParameterRebound):
                did = "returned" if e is None else f"raised {type(e).__name__}: {e}"
                self._violate("stale", f"T{i}: send_weights({v}) after {name!r} was rebound "
                                       f"{did}")
        for i, storage in registered.items():
            p = self.trainers[i][0].params[name]
            storage.copy_(p.data)
            p.data = storage
        if out is not None and not self.ended:
            self._update(None)

    def _call_all(self, what: str, call) -> dict[int, BaseException | None] | None:
        """``call(adapter)`` on every live trainer at once; what each raised (None: it
        returned), for the trainers still live; None if one hung (a violation)."""
        live = list(self.live_trainers)
        out: dict[int, BaseException | None] = {}

        def one(i: int) -> None:
            try:
                call(self.trainers[i][1])
                out[i] = None
            except BaseException as e:  # noqa: BLE001  (classified below)
                out[i] = e
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in live]
        for t in threads:
            t.start()
        end = time.monotonic() + self.bound
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        for i in live:
            if i in self.live_trainers and i not in out:
                self._violate("hang", f"T{i}: {what} did not return within {self.bound:g}s")
                return None
        return {i: out[i] for i in live if i in self.live_trainers}

    def _collective(self, what: str, call) -> bool:
        """``call(adapter)`` on every live trainer at once; True if none raised."""
        out = self._call_all(what, call)
        if out is None:
            return False
        ok = True
        for i, e in out.items():
            if e is None:
                continue
            ok = False
            self.trainer_errors.append(f"T{i} {what}: {type(e).__name__}: {e}")
            if not _documented(e):
                self._violate("error", f"T{i} {what} raised {type(e).__name__}: {e}")
            elif "build a new group" in str(e) or "No engine is left" in str(e):
                self.ended = True
        return ok

    # -- the rollout ranks ---------------------------------------------------------------------

    def _add_engine(self, engine: int) -> None:
        size = self.s.engine_size
        self.barriers[engine] = threading.Barrier(size)
        for k in range(size):
            m = Model()
            self.ranks.append(_Rank(m, self.control.add(ReceiverAdapter(
                m.params, m.load_weights, SPEC, rank=engine * size + k, engine=engine,
                engine_rank=k, engine_size=size, control=self.control,
                transport=self.control.transport, config=self.config))))

    def _start(self, rank: _Rank) -> None:
        rank.thread = threading.Thread(target=self._loop, args=(rank,), daemon=True,
                                       name=f"fuzz-{rank.receiver.worker}")
        rank.thread.start()

    def _loop(self, rank: _Rank) -> None:
        r, engine = rank.receiver, rank.receiver.engine
        think = self.s.think_s[engine % len(self.s.think_s)]
        barrier = self.barriers[engine]
        while not self.stop.is_set() and not rank.dead and rank.told_polls < _TOLD_POLLS:
            while not self.stop.is_set() and (
                    self.control.stalled(r.worker)
                    or time.monotonic() < self.paused_until.get(engine, 0.0)):
                time.sleep(0.002)
            if rank.dead or self.stop.is_set():
                break
            self._poll(rank)
            if rank.synced:
                try:
                    barrier.wait(timeout=self.bound)
                except threading.BrokenBarrierError:
                    rank.synced = False
            if think:
                time.sleep(think)
        if not rank.dead:
            barrier.abort()  # (its siblings go on out of step)

    def _poll(self, rank: _Rank) -> None:
        r = rank.receiver
        # (A joining engine holds no version until its first install: the join probes its
        # parameters, docs/delta-elastic.md, "Engines joining and leaving".)
        fresh = rank.joined and r.version == 0
        changed = [n for n, p in rank.model.params.items() if not same_bytes(p, rank.snapshot[n])]
        if changed and not rank.dead and not fresh:
            self._violate("outside", f"{r.worker}: {changed} changed between two polls "
                                     f"(version {r.version})")
        try:
            got = r.poll_requests()
        except TransferFailed as e:
            rank.told = rank.told or str(e)
            rank.told_polls += 1
            rank.history.append(None)
            return
        except TimeoutError:
            rank.history.append(None)
            return
        except Exception as e:  # noqa: BLE001  (not documented for poll_requests)
            if not rank.dead:
                self._violate("error", f"{r.worker}: poll_requests raised "
                                       f"{type(e).__name__}: {e}")
            rank.history.append(None)
            return
        finally:
            rank.snapshot = {n: p.clone() for n, p in rank.model.params.items()}
        if rank.dead:
            return
        held = r.version
        if held == 0:  # no version installed yet: probe values (docs/integration.md)
            return
        rank.history.append(held)
        if rank.told:
            self._violate("untold", f"{r.worker}: poll_requests returned {got} (holding "
                                    f"{held}) after raising TransferFailed ({rank.told[:80]})")
        if held < rank.seen or (got is not None and got != held):
            self._violate("decrease", f"{r.worker}: poll returned {got}, holds {held}, had "
                                      f"{rank.seen}")
        rank.seen = max(rank.seen, held)
        want = self.truth.get(held)
        bad = (sorted(SHAPES) if want is None else
               [n for n, p in rank.model.params.items()
                if not same_bytes(p, self._value(n, want[n]))])
        if bad:
            self._violate("torn", f"{r.worker} (engine {r.engine}): poll returned {got}, "
                                  f"holds version {held}, but {bad} are not its bytes")

    def _settle(self, last: int | None) -> None:
        """Let every rank poll until it holds ``last`` or is told; then check who is out."""
        end = time.monotonic() + 6 * self.s.timeout_s + 5
        while time.monotonic() < end and not all(
                rank.dead or rank.told or (last is not None and rank.receiver.version >= last)
                or rank.thread is None or not rank.thread.is_alive() for rank in self.ranks):
            time.sleep(0.01)
        self.stop.set()
        for b in self.barriers.values():
            b.abort()
        for rank in self.ranks:
            if rank.thread is not None:
                rank.thread.join(self.bound)
        excluded = set()
        if not self.ended and self.trainers[0][1].plan is not None:
            excluded = set(self.trainers[0][1].failed_engines)
        if last is None and not self.ended and not self._hung():
            self._violate("wedged", f"no final update went through: "
                                    f"{'; '.join(e[:160] for e in self.trainer_errors[-2:])}")
        for rank in self.ranks:
            r = rank.receiver
            if rank.dead or rank.told:
                continue
            why = ("the group ended (trainer 0 died or the group is broken)" if self.ended
                   else self.out_engines.get(r.engine)
                   or ("excluded by trainer 0" if r.engine in excluded else None))
            if why is not None:
                self._violate("untold", f"{r.worker} (engine {r.engine}, {why}): never told, "
                                        f"holds version {r.version}")
            elif last is not None and r.version != last:
                self._violate("not_at_last", f"{r.worker} (engine {r.engine}) holds version "
                                             f"{r.version}, not the last one sent ({last})")
        self._check_lockstep()

    def _check_lockstep(self) -> None:
        size = self.s.engine_size
        for e in range(len(self.ranks) // size):
            hist = [rank.history for rank in self.ranks[e * size:(e + 1) * size]]
            if any(rank.dead for rank in self.ranks[e * size:(e + 1) * size]):
                continue
            for step, held in enumerate(zip(*hist)):
                if None not in held and len(set(held)) > 1:
                    self._violate("mixed", f"engine {e}: its ranks held versions {held} after "
                                           f"step {step}")
                    break

    def finish(self) -> None:
        self.stop.set()
        for b in self.barriers.values():
            b.abort()
        for w in list(self.control._stalled):
            self.control.resume(w)

    # -- helpers -------------------------------------------------------------------------------

    def _value(self, tensor: str, version: int) -> torch.Tensor:
        key = (tensor, version)
        if key not in self.cache:
            self.cache[key] = value(tensor, version)
        return self.cache[key]

    def _hung(self) -> bool:
        return any(v.kind == "hang" for v in self.violations)

    def _violate(self, kind: str, detail: str) -> None:
        """Record a violation: once per kind and worker (or call) in a seed."""
        key = (kind, detail.split(":")[0])
        with self.lock:
            if key not in self.seen_keys:
                self.seen_keys.add(key)
                self.violations.append(Violation(kind, detail))


def _documented(e: BaseException) -> bool:
    """What send_weights, add_engines and remove_engine are documented to raise."""
    if isinstance(e, _TOLERATED):
        return True
    text = str(e)
    if isinstance(e, RuntimeError):
        return any(s in text for s in ("a background transfer failed",
                                       "trainer 0's connect failed"))
    if isinstance(e, ValueError):  # a leave refused: the library excluded engines meanwhile
        return "last engine" in text or "already" in text or "is out" in text
    return False
