"""Fail closed on real Monarch meshes: a rollout process that dies or stalls mid-transfer.

Trainer TP2 -> two TP2 engines (`meshes/adapter_actors.py`, as in `examples/rl_loop.py`) on
proc meshes of their own, one `TransferGroup` over both; rollout worker R1 (engine 0) calls
``os._exit`` (or stops itself with SIGSTOP: alive, answering nothing) at the third round of
the second transfer (in its adapter's ``on_land``,
which the group's agent runs for trainer 0's sequencer; the adapter class is substituted with
``group.receiver(..., cls=...)``). Checked: trainer 0 raises a `TransferFailed` naming R1,
engine 0, version 2, the round and the stage within ``timeout_s`` of the fault; engine 1 runs one
version per step,
bit-exact at every install, and ends on the last version (the next ``send_weights`` goes on
with it); engine 0's steps fail; every proc is gone afterwards.
"""

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from meshes.adapter_actors import RLRollout, RLTrainer
from meshprocs import bootstrap_children, proc_pair
from weightbridge import ReceiverAdapter, TransferConfig, TransferGroup

pytestmark = pytest.mark.mesh

TRAINER_TP, ENGINES, ENGINE_TP = 2, 2, 2
VICTIM, LAST, TIMEOUT_S = 1, 3, 10.0


FAULT_ENV = "WB_TEST_FAULT_DIR"
"""A folder where the victim writes when its fault happens (``fault_at``: the fault is timed
from there, one monotonic clock for all procs) and the stalling one its pid before it stops
itself (so the test can kill it afterwards: a stopped process does not end when its mesh is
stopped)."""


class DiesInSecondTransfer(ReceiverAdapter):
    """Rollout worker VICTIM's process exits as it lands a round from round 3 on of the
    second transfer. A transfer starts with the first round it assembles in (whichever way
    the rounds are driven it lands that one; rounds from two after it on cannot land before
    it, with two round buffers, though lands may run side by side)."""

    transfers = 0

    def on_land(self, r: int, slots=None, expected=None) -> None:
        if self.worker.index == VICTIM:
            first = min(i for i, part in enumerate(self.executor.plan.rounds) if part.assemble)
            self.transfers += r == first
            if self.transfers == 2 and r >= max(3, first + 2):
                self.fault()
        super().on_land(r, slots, expected)

    def fault(self) -> None:
        _fault_at()
        os._exit(1)


class StallsInSecondTransfer(DiesInSecondTransfer):
    """Rollout worker VICTIM's process stops (SIGSTOP) at the same point: alive, silent."""

    def fault(self) -> None:
        _fault_at()
        (Path(os.environ[FAULT_ENV]) / str(os.getpid())).write_text("")
        os.kill(os.getpid(), signal.SIGSTOP)


def _fault_at() -> None:
    (Path(os.environ[FAULT_ENV]) / "fault_at").write_text(str(time.monotonic()))


class FaultyRollout(RLRollout):
    """`RLRollout` whose adapter is a `DiesInSecondTransfer` (``group.receiver(cls=...)``)."""

    receiver_cls = DiesInSecondTransfer


class StallingRollout(RLRollout):
    """`RLRollout` whose adapter is a `StallsInSecondTransfer`."""

    receiver_cls = StallsInSecondTransfer


@pytest.mark.parametrize("fault", ["killed", "stalled"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rollout_proc_lost_mid_transfer_fails_closed_and_the_survivors_go_on(
        mode, fault, tmp_path, monkeypatch):
    ss = rs = mode == "async"
    config = TransferConfig(sender_staging=ss, receiver_staging=rs, timeout_s=TIMEOUT_S,
                            round_bytes=64 << 10)
    monkeypatch.setenv(FAULT_ENV, str(tmp_path))  # the procs inherit it
    rollout_cls = FaultyRollout if fault == "killed" else StallingRollout
    before = bootstrap_children()
    try:
        with proc_pair(TRAINER_TP, ENGINES * ENGINE_TP) as (tp, rp):
            # No group.close(): the victim's proc is gone or stopped, and stopping the procs
            # (proc_pair) ends the agents and the actors with them.
            group = TransferGroup.spawn(tp, rp, engine_size=ENGINE_TP, config=config)
            trainers = tp.spawn("trainer_fc", RLTrainer, "tiny", TRAINER_TP)
            rollouts = rp.spawn("rollout_fc", rollout_cls, "tiny", ENGINE_TP)
            setups = [trainers.setup.call(group), rollouts.setup.call(group)]
            for f in setups:
                f.get(timeout=120)
            trainers.connect.call().get(timeout=300)
            run = _drive(trainers, rollouts, ss, lambda: _kill_stopped(tmp_path))
            _check(run, ss, fault_at=float((tmp_path / "fault_at").read_text()))
    finally:
        _kill_stopped(tmp_path)
    assert bootstrap_children() - before == set()


def _kill_stopped(folder: Path) -> None:
    for f in folder.iterdir():
        if not f.name.isdigit():
            continue
        try:
            os.kill(int(f.name), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _drive(trainers, rollouts, ss: bool, sent) -> dict:
    """Versions 1..LAST from the trainers while both engines step on their own threads;
    ``sent()`` once the last send returned (the stopped victim is killed there)."""
    records: list[dict] = []
    engine_errors: dict[int, BaseException] = {}
    failures: list[tuple[int, str, float]] = []  # (version, error, when raised)
    stop, killed = threading.Event(), threading.Event()

    def answer(call, rank: int):
        # A call the victim took before it stopped is answered only once Monarch notices it
        # was killed (about 25 s here): given up on once the sends are over and it is killed.
        end = time.monotonic() + 4 * TIMEOUT_S
        while True:
            try:
                return call.get(timeout=0.25)
            except TimeoutError:
                if rank == VICTIM and killed.is_set():
                    raise RuntimeError(f"R{rank}'s step: its process was stopped, then killed")
                if time.monotonic() > end:
                    raise

    def generate(engine: int):
        # A call per rank, answers taken in rank order: engine 0's first rank fails at once
        # where its poll raises (sync), and the victim's call is given up on (`answer`).
        flat = rollouts.flatten("rank")
        ranks = range(engine * ENGINE_TP, (engine + 1) * ENGINE_TP)
        seed = 0
        try:
            while not stop.is_set():
                calls = [flat.slice(rank=r).step.call_one(seed) for r in ranks]
                out = [answer(call, r) for call, r in zip(calls, ranks)]
                seed += 1
                records.extend(dict(r, engine=engine) for r in out)
                if all(r["version"] == LAST for r in out):
                    return
        except Exception as e:  # noqa: BLE001  (engine 0 is expected to end here)
            engine_errors[engine] = e

    threads = [threading.Thread(target=generate, args=(e,)) for e in range(ENGINES)]
    for t in threads:
        t.start()
    try:
        for v in range(1, LAST + 1):
            try:
                trainers.train_and_send.call(v).get(timeout=6 * TIMEOUT_S)
                if ss:  # one transfer at a time: the second one carries version 2
                    trainers.finish.call().get(timeout=6 * TIMEOUT_S)
            except Exception as e:  # noqa: BLE001  (the error under test)
                failures.append((v, str(e), time.monotonic()))
        sent()
        killed.set()
        for t in threads:
            t.join(timeout=6 * TIMEOUT_S)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=6 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "an engine hung"
    return {"records": records, "engine_errors": engine_errors, "failures": failures}


def _check(run: dict, ss: bool, fault_at: float) -> None:
    failures = run["failures"]
    assert [v for v, *_ in failures] == [2], [(v, m[-800:]) for v, m, *_ in failures]
    _, message, end = failures[0]
    elapsed = end - fault_at  # (one monotonic clock for all procs)
    assert "R1 (engine 0) failed during the transfer of version 2" in message, message[-2000:]
    # The step that meets the dead worker first names it: its round (a peer waiting for its
    # bytes, a trainer writing into it, its own round unanswered); with round_control
    # "stages", a trainer's send, a forward of either stage, or its land.
    stage = (r"(send, forwards and land|trainers' send|rollouts' (external|internal) forward|"
             r"rollouts' land)")
    assert re.search(r"round \d+, " + stage, message), message[-2000:]
    assert "Engine [0] is excluded" in message and "add_engines()" in message, message[-2000:]
    # Within timeout_s of the fault: peers count as lost after peer_timeout_s, the rest of the
    # budget finds which and re-plans (and, in sync mode, re-sends the version to the
    # survivors). A stalled process (SIGSTOP) answers nothing, so only the timeouts find it.
    print(f"TransferFailed {elapsed:.1f}s after the fault (timeout_s={TIMEOUT_S})")
    assert elapsed < TIMEOUT_S, elapsed
    assert 0 in run["engine_errors"] and 1 not in run["engine_errors"], run["engine_errors"]
    survivors = [r for r in run["records"] if r["engine"] == 1]
    by_step: dict[int, set] = {}
    for r in survivors:
        by_step.setdefault(r["step"], set()).add(r["version"])
    assert all(len(v) == 1 for v in by_step.values()), by_step
    assert all(r["exact"] is not False for r in survivors)
    installed = {r["rank"]: [] for r in survivors}
    for r in sorted(survivors, key=lambda r: r["step"]):
        if r["installed"] is not None:
            installed[r["rank"]].append(r["installed"])
    for rank, got in installed.items():
        assert got == sorted(set(got)) and got[-1] == LAST, (rank, got)
        assert (2 in got) is (not ss), (rank, got)
    last_step = max(by_step)
    assert by_step[last_step] == {LAST}
