"""A protocol fuzz of the controller's path (`MeshTransfer`) on real local Monarch meshes.

Each seed runs a few random operations on a long-lived `MeshTransfer` of its mode (``seed %
4``: sync, SS, RS, async; every other run of four seeds with ``round_control="rounds"``;
DP2 trainers, two engines of the tiny demo model at first, whose rollouts pad the
vocabulary rows of the embedding and lm_head): full and delta updates, a join after the
next train step, a join or a ``remove_engine`` from another thread while an update runs, a
``replan``, and a train step that rebinds every trainer parameter's storage (``p.data =
copy``; restored afterwards). After every operation it waits for the stream
(`MeshTransfer.wait`), polls (`poll_requests`) and compares every live engine's parameters,
bit for bit (checksums on the rollouts), with their own load_weights of the version of each
tensor that this fuzz, not the controller's books, says they hold. The kinds of `Violation`:

    stale    a live engine's parameters are not the bytes of what it must hold: a tensor
             of an older version, torn or blended bytes (a join that re-sent the trainers'
             live weights, a rebound storage shipped, a padded replica unchecked)
    error    a call raised something other than the library's documented refusal for that
             operation (`CatchUpRefused` for a join after a train step, `ParameterRebound`
             for a rebound storage), or anything outside `WeightBridgeError` / ValueError
    late     a call that raised took longer than ``timeout_s`` x (rounds + 2), the bound of
             a whole transfer (a fault must surface within its bound)

A seed that shows ``error`` ends its `MeshTransfer` (the next seed starts a new one): a
group in an unknown state must not count against later seeds. `benchmarks/fuzz_protocol.py
--path controller` runs many seeds.

Typical usage::

    for result in run_seeds(range(8), num_ops=4, timeout_s=5.0):
        print(result.seed, result.violations)
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from monarch.actor import endpoint

from controller.driver import MeshTransfer
from meshes.actors import TrainerActor
from weightbridge import CatchUpRefused, ParameterRebound, TransferConfig, WeightBridgeError
from weightbridge.config import ROUND_CONTROLS
from weightbridge.driver import Mode, RolloutSpec, TrainerSpec
from fuzz_adapters import Violation  # (kind: one of this module's KINDS)

KINDS = ("stale", "error", "late")
MODES = ("sync", "ss", "rs", "async")
OPS = ("update", "delta", "join_after_step", "join_from_thread", "remove_from_thread",
       "replan", "rebind")
MAX_ENGINES = 3
"""A join when this many engines are live removes one instead (the group stays small)."""
SEEDS_PER_GROUP = 20
"""Seeds one `MeshTransfer` runs before a new one starts (long-lived groups: the state of
many joins, removals and re-plans piles up in each)."""
DELTA = ("model.norm.weight", "lm_head.weight")
"""The tensors a delta update changes (one of them; lm_head is a padded one)."""


@dataclass(frozen=True, slots=True)
class SeedResult:
    seed: int
    mode: str
    round_control: str
    ops: tuple[str, ...]
    violations: tuple[Violation, ...]
    refusals: tuple[str, ...]
    """The documented refusals seen (not violations)."""
    wall_s: float


class RebindingTrainer(TrainerActor):
    """A trainer whose parameters can be moved to new storage and back (the fuzz's
    ``rebind``: as ``load_state_dict(assign=True)`` does; the values stay)."""

    @endpoint
    def rebind(self, restore: bool) -> None:
        """``p.data = copy`` of every parameter, or (``restore``) back to the storage
        registered at connect, with the values the copies hold."""
        kept = self.__dict__.setdefault("_registered", {})
        with torch.no_grad():
            for name, p in self.parts.params.items():
                if restore:
                    if name in kept:
                        kept[name].copy_(p)
                        p.data = kept.pop(name)
                else:
                    kept.setdefault(name, p.data)
                    p.data = p.detach().clone()


def run_seeds(seeds: Iterable[int], *, num_ops: int = 4, timeout_s: float = 5.0
              ) -> list[SeedResult]:
    """Every seed of ``seeds``, each on the `MeshTransfer` of its mode and round control
    (`round_control`; kept for `SEEDS_PER_GROUP` seeds, or until one shows ``error``)."""
    results, open_ = [], {}
    try:
        for seed in seeds:
            key = MODES[seed % len(MODES)], round_control(seed)
            if key not in open_:
                open_[key] = _Group(*key, timeout_s)
            result = open_[key].run(seed, num_ops)
            results.append(result)
            if any(v.kind == "error" for v in result.violations) \
                    or open_[key].seeds >= SEEDS_PER_GROUP:
                open_.pop(key).close()
    finally:
        for group in open_.values():
            group.close()
    return results


def round_control(seed: int) -> str:
    """`TransferConfig.round_control` of ``seed``: every other run of four seeds (one per
    mode) drives its rounds whole, as the adapters' fuzz does (`fuzz_plan`)."""
    return ROUND_CONTROLS[seed // len(MODES) % len(ROUND_CONTROLS)]


class _Group:
    """One mode's `MeshTransfer` and what its engines must hold (this fuzz's own books)."""

    def __init__(self, mode: str, round_control: str, timeout_s: float):
        m = Mode(mode)
        self.mode, self.round_control, self.timeout_s = mode, round_control, timeout_s
        self.mt = MeshTransfer(TrainerSpec.parse("nodes=2,gpus=1"),
                               RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                               trainer_actor=RebindingTrainer,
                               config=TransferConfig(round_bytes=64 << 10, timeout_s=timeout_s,
                                                     sender_staging=m.sender_staging,
                                                     receiver_staging=m.receiver_staging,
                                                     round_control=round_control))
        self.mt.__enter__()
        self.mt.connect()
        self.version, self.seeds = 0, 0
        self.holds: dict[str, int] | None = None
        """Tensor -> the version every live engine must hold (None: nothing sent yet)."""
        self.trained: dict[str, int] = {}
        """Tensor -> the version the trainers' parameters hold: a version whose update was
        refused after its train step is the base of the next delta (it sends what the
        rollouts lack)."""

    def close(self) -> None:
        self.mt.close()

    def run(self, seed: int, num_ops: int) -> SeedResult:
        rng, t0 = random.Random(seed), time.monotonic()
        self.seeds += 1
        ops = tuple(rng.choice(OPS) for _ in range(num_ops))
        self.violations: list[Violation] = []
        self.refusals: list[str] = []
        for op in ops:
            getattr(self, f"_{op}")(rng)
            self._check(op)
            if any(v.kind == "error" for v in self.violations):
                break
        return SeedResult(seed, self.mode, self.round_control, ops, tuple(self.violations),
                          tuple(self.refusals), time.monotonic() - t0)

    # -- calls --------------------------------------------------------------------------------

    def _call(self, what: str, call, *args, refused=(), **kwargs) -> bool:
        """``call(*args, **kwargs)``; True if it returned. A refusal of a kind in ``refused``
        is noted; anything else, or a raise past the bound, is a violation."""
        t0 = time.monotonic()
        try:
            call(*args, **kwargs)
            return True
        except BaseException as e:  # noqa: BLE001  (classified: the fuzz's point)
            took = time.monotonic() - t0
            bound = self.mt._deadline() / 2  # (timeout_s x (rounds + 2))
            if took > bound:
                self.violations.append(Violation("late", f"{what}: {type(e).__name__} after "
                                                         f"{took:.1f}s > {bound:.0f}s"))
            if isinstance(e, refused):
                self.refusals.append(f"{what}: {type(e).__name__}")
            else:
                kind = "documented" if isinstance(e, (WeightBridgeError, ValueError)) else \
                    "UNDOCUMENTED"
                self.violations.append(Violation("error", f"{what}: {kind} "
                                                          f"{type(e).__name__}: {e}"[:400]))
            return False

    def _send(self, what: str, *, changed=None, train: bool = True, refused=()) -> bool:
        self.version += 1
        if train:  # (every refusal here comes after the train step)
            self._train(self.version, changed)
        if self._call(what, self.mt.update, self.version, changed, train=train,
                      refused=refused):
            self.holds = dict(self.trained)
            return True
        return False

    def _train(self, version: int, changed=None) -> None:
        tensors = changed if changed is not None else self.mt.book.tensors
        self.trained = {**self.trained, **dict.fromkeys(tensors, version)}

    def _threaded(self, what: str, membership) -> None:
        """An update on a thread of its own, ``membership`` on this one while it runs."""
        done: list[bool] = []
        version = self.version + 1
        updating = threading.Thread(target=lambda: done.append(self._send(what)))
        updating.start()
        time.sleep(0.05)  # (usually inside the update's rounds)
        membership()
        updating.join(self.mt._deadline())
        if updating.is_alive():
            self.violations.append(Violation("late", f"{what}: update({version}) did not "
                                                     f"return within the deadline"))

    # -- the operations ------------------------------------------------------------------------

    def _update(self, rng) -> None:
        self._send("update")

    def _delta(self, rng) -> None:
        if self.holds is None:
            self._send("update")
        else:
            self._send("delta", changed=[rng.choice(DELTA)])

    def _join_or_leave(self, what: str) -> None:
        live = sorted(set(range(self.mt.rollout_spec.engines)) - self.mt.lost_engines)
        if len(live) >= MAX_ENGINES:
            self._call(f"{what} (remove)", self.mt.remove_engine, live[0])
        else:
            self._call(what, self.mt.add_engine, refused=(CatchUpRefused,))

    def _join_after_step(self, rng) -> None:
        """The documented loop's hazard: the trainers train v + 1 right after update(v)."""
        if self.holds is None:
            self._send("update")
        step = self.version + 1
        if not self._call("train_step", lambda: self.mt.trainers.train_step.call(step).get()):
            return
        self._train(step)
        self._join_or_leave("join after a train step")
        self._send("update after the join", train=False)

    def _join_from_thread(self, rng) -> None:
        self._threaded("update during a join", lambda: self._join_or_leave("join from a thread"))

    def _remove_from_thread(self, rng) -> None:
        live = sorted(set(range(self.mt.rollout_spec.engines)) - self.mt.lost_engines)
        if len(live) < 2:
            return self._join_from_thread(rng)
        engine = rng.choice(live)
        self._threaded("update during a leave",
                       lambda: self._call("remove from a thread", self.mt.remove_engine, engine))

    def _replan(self, rng) -> None:
        self._call("replan", self.mt.replan)

    def _rebind(self, rng) -> None:
        if not self._call("rebind", lambda: self.mt.trainers.rebind.call(False).get()):
            return
        if self._send("update after a rebind", refused=(ParameterRebound,)):
            self.violations.append(Violation("stale", "an update after every trainer parameter "
                                                      "was rebound was not refused"))
        self._call("restore", lambda: self.mt.trainers.rebind.call(True).get())

    # -- the check -----------------------------------------------------------------------------

    def _check(self, op: str) -> None:
        """Every live engine holds, bit for bit, what this fuzz says it must."""
        self._call(f"{op}: wait", self.mt.wait)
        self._call(f"{op}: poll_requests", self.mt.poll_requests)
        if self.holds is None:
            return
        runs = self.mt._live("rollout")
        count, bad = self.mt._verify(runs, dict(self.holds))
        if bad or not count:
            self.violations.append(Violation("stale", f"after {op}: {len(bad)} of {count} "
                                                      f"parameters differ, e.g. {list(bad[:3])}"))
