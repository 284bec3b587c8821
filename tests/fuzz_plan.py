"""The protocol fuzz's scenarios: a seed -> the group, and the operations run on it (pure),
and the model every rank holds.

A scenario is a small adapter group (one or two data-parallel trainers, one to three engines
of one or two ranks, every rank holding the whole three-tensor model of `SHAPES`) in one of
the four sync modes (the seed modulo 4), and a list of operations the fuzz's script runs in
order. Updates and membership changes are collective calls on the trainers; faults (`kill`,
`stall`, `pause`) start ``delay_s`` after the operation before them and overlap what follows.

    update  send_weights(v) on every live trainer (full, or a delta: ``changed``)
    join    a new engine's receivers are added, then add_engines() on every trainer
    leave   remove_engine(engine) on every trainer
    kill    rollout worker ``worker`` dies (`LocalControl.kill`); trainer ``worker`` if
            ``side`` is "trainer" (trainer 0: the group ends)
    stall   rollout worker ``worker`` stops for ``seconds`` (`LocalControl.stall`: a SIGSTOP)
    pause   engine ``engine`` stops polling for ``seconds`` (alive, answering its peers)
    rebind  a train step rebinds one tensor's storage on every live trainer (``p.data =
            new``): each send_weights must refuse it; the values are then written into the
            registered storage and sent in full (drawn on an RNG of its own: the other
            operations of a seed are those drawn without it)

Typical usage::

    scenario = scenario_of(seed=7)
    print(scenario.describe())
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from weightbridge.config import ROUND_CONTROLS

MODES = ("sync", "ss", "rs", "async")
"""Mode of seed s: MODES[s % 4]."""
SHAPES = {"w": ((3,), torch.bfloat16), "v": ((5,), torch.float32), "m": ((4, 6), torch.bfloat16)}
"""The model every rank holds whole: rounds of odd byte counts, three tensors to delta."""


def value(tensor: str, version: int) -> torch.Tensor:
    """The bytes of ``tensor`` as of the trainers' step ``version`` (0: where all start)."""
    shape, dtype = SHAPES[tensor]
    gen = torch.Generator().manual_seed(1000 * version + sorted(SHAPES).index(tensor))
    return torch.randn(shape, generator=gen).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Model:
    """One rank's copy of the whole model (trainer or rollout), starting at version 0."""

    def __init__(self):
        self.params = {n: value(n, 0).clone() for n in SHAPES}

    def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, t in weights:
                self.params[name].copy_(t)


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    """"update", "join", "leave", "kill", "stall", "pause" or "rebind"."""
    changed: tuple[str, ...] | None = None
    """update: the tensors that changed (None: a full update)."""
    engine: int = -1
    """leave, pause: the engine."""
    worker: int = -1
    """kill, stall: the worker's index on its side."""
    side: str = "rollout"
    """kill: "rollout" or "trainer"."""
    seconds: float = 0.0
    """stall, pause: how long."""
    delay_s: float = 0.0
    """kill, stall, pause: how long after the operation before it this one starts."""

    def describe(self) -> str:
        if self.kind == "update":
            return "full" if self.changed is None else f"delta{list(self.changed)}"
        if self.kind in ("join", "rebind"):
            return self.kind
        if self.kind == "leave":
            return f"leave(e{self.engine})"
        who = f"{'T' if self.side == 'trainer' else 'R'}{self.worker}" if self.worker >= 0 \
            else f"e{self.engine}"
        extra = f" {self.seconds:.2f}s" if self.seconds else ""
        return f"{self.kind}({who}{extra} +{self.delay_s:.2f}s)"


@dataclass(frozen=True, slots=True)
class Scenario:
    seed: int
    mode: str
    num_trainers: int
    num_engines: int
    engine_size: int
    timeout_s: float
    ops: tuple[Op, ...]
    think_s: tuple[float, ...]
    """Per engine (joined ones cycle through it), the pause between its inference steps."""
    round_control: str = "stages"
    """`TransferConfig.round_control`: every other run of four seeds (one per mode) drives
    its rounds whole ("rounds")."""

    @property
    def staging(self) -> tuple[bool, bool]:
        """(sender_staging, receiver_staging)."""
        return self.mode in ("ss", "async"), self.mode in ("rs", "async")

    def describe(self) -> str:
        return (f"seed {self.seed}: {self.mode}, {self.round_control}, "
                f"{self.num_trainers} trainers -> "
                f"{self.num_engines} x {self.engine_size}-rank engines, timeout_s="
                f"{self.timeout_s:g}: " + ", ".join(op.describe() for op in self.ops))


FAULTS = ("kill", "stall", "pause")


REBIND_SHARE = 0.3
"""Share of seeds with one ``rebind`` operation (`scenario_of`)."""


def scenario_of(seed: int, *, num_ops: int = 8, timeout_s: float = 1.0,
                faults: bool | tuple[str, ...] = True, rebinds: bool = True) -> Scenario:
    """The scenario of ``seed``: ``num_ops`` operations after a first full update, at most
    one trainer kill, joins up to four engines. ``faults``: True (every kind of `FAULTS`),
    False (updates and membership changes only) or the kinds to draw. ``rebinds``: a share
    `REBIND_SHARE` of seeds get one ``rebind`` somewhere after the first update."""
    kinds_of_fault = FAULTS if faults is True else tuple(faults or ())
    if not set(kinds_of_fault) <= set(FAULTS):
        raise ValueError(f"faults must be True, False or kinds among {FAULTS}, got {faults!r}")
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]
    trainers = rng.choice((1, 2))
    engines, size = rng.choice((1, 2, 2, 3)), rng.choice((1, 1, 2))
    ops: list[Op] = [Op("update")]
    live_engines = list(range(engines))
    total_engines, live_trainers, killed = engines, trainers, set()
    kinds = ["update"] * 5 + ["join", "leave"] + [k for k in ("kill", "stall", "stall", "pause",
                                                              "pause") if k in kinds_of_fault]
    for _ in range(num_ops):
        kind = rng.choice(kinds)
        rollout_workers = [j for e in live_engines for j in range(e * size, (e + 1) * size)
                           if j not in killed]
        if kind == "update":
            changed = None
            if rng.random() < 0.6:  # (every mode: with sender staging all tensors move)
                changed = tuple(sorted(rng.sample(sorted(SHAPES), rng.randint(0, 3))))
            ops.append(Op("update", changed=changed))
        elif kind == "join" and total_engines < 4:
            ops.append(Op("join"))
            live_engines.append(total_engines)
            total_engines += 1
        elif kind == "leave" and len(live_engines) > 1:
            e = rng.choice(live_engines)
            live_engines.remove(e)
            ops.append(Op("leave", engine=e))
        elif kind == "kill":
            if live_trainers > 1 and rng.random() < 0.3:
                live_trainers -= 1
                ops.append(Op("kill", worker=1, side="trainer", delay_s=_delay(rng)))
            elif len(rollout_workers) > size:
                j = rng.choice(rollout_workers)
                killed.add(j)
                ops.append(Op("kill", worker=j, delay_s=_delay(rng)))
        elif kind == "stall" and rollout_workers:
            long = rng.random() < 0.3
            seconds = timeout_s * (rng.uniform(1.2, 2.0) if long else rng.uniform(0.05, 0.4))
            ops.append(Op("stall", worker=rng.choice(rollout_workers), seconds=seconds,
                          delay_s=_delay(rng)))
        elif kind == "pause" and live_engines:
            ops.append(Op("pause", engine=rng.choice(live_engines),
                          seconds=timeout_s * rng.uniform(0.1, 1.5), delay_s=_delay(rng)))
    if "kill" in kinds_of_fault and rng.random() < 0.05:  # trainer 0 dies: the group ends
        ops.append(Op("kill", worker=0, side="trainer", delay_s=_delay(rng)))
    think = tuple(rng.choice((0.0, 0.001, 0.003, 0.01)) for _ in range(4))
    misuse = random.Random(seed * 7907 + 3)  # (its own draws: the others stay as they were)
    if rebinds and misuse.random() < REBIND_SHARE:
        ops.insert(misuse.randint(1, len(ops)), Op("rebind"))
    return Scenario(seed, mode, trainers, engines, size, timeout_s, tuple(ops), think,
                    ROUND_CONTROLS[seed // len(MODES) % len(ROUND_CONTROLS)])


def _delay(rng: random.Random) -> float:
    return rng.choice((0.0, 0.002, 0.01, 0.03, 0.1))
