"""The adapters over the real planner, executor and copy kernels, in one process.

Trainer and rollout workers are threads; `LocalControl` stands in for actor endpoints and
`LocalTransport` for RDMA writes. Each rollout engine runs its ranks in lockstep (a barrier
after every inference step, as an engine's collectives would), polling before every step.
Checked in every mode: bit-exact weights at every install, one version per engine at every
step, versions in order, and who waits for whom (ordering of logged events, no wall-clock
thresholds).
"""

import threading

import pytest
import torch

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig
from weightbridge.coordination.local_control import LocalControl

CONFIG = SIZES["tiny"]
SPEC = checkpoint_spec(CONFIG)
TRAINER_TP = 2
ENGINES, ENGINE_TP = 2, 2
NUM_VERSIONS = 3


def _checkpoint(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + version)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in SPEC.tensors}


CHECKPOINTS = {v: _checkpoint(v) for v in range(NUM_VERSIONS + 4)}


def _reference(rank_in_engine: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for v, ckpt in CHECKPOINTS.items():
        s = RolloutShard(CONFIG, ENGINE_TP, rank_in_engine, 1, 0)
        s.load_weights(ckpt.items())
        out[v] = {n: p.clone() for n, p in s.params.items()}
    return out


REFERENCE = {k: _reference(k) for k in range(ENGINE_TP)}


def _group(options: TransferConfig, hook=None, receiver_cls=lambda rank: ReceiverAdapter,
           after=None):
    """Trainers and engines on one LocalControl; ``receiver_cls(rank)`` picks each rollout's
    adapter class (tests substitute faulty ones)."""
    control = LocalControl()
    trainers = []
    for i in range(TRAINER_TP):
        shard = TrainerShard(CONFIG, TRAINER_TP, i, 1, 0)
        shard.load_weights(CHECKPOINTS[0].items())
        trainers.append((shard, control.add(SenderAdapter(
            shard.params, shard.load_weights, SPEC, rank=i, control=control,
            transport=control.transport, config=options))))
    rollouts = []
    for e in range(ENGINES):
        for k in range(ENGINE_TP):
            shard = RolloutShard(CONFIG, ENGINE_TP, k, 1, 0)
            shard.load_weights(CHECKPOINTS[0].items())
            rollouts.append((shard, control.add(receiver_cls(e * ENGINE_TP + k)(
                shard.params, shard.load_weights, SPEC, rank=e * ENGINE_TP + k, engine=e,
                engine_rank=k, engine_size=ENGINE_TP, control=control,
                transport=control.transport, config=options, before_update_hook=hook,
                after_update_hook=None if after is None else
                (lambda v, shard=shard, k=k: after(shard, k, v))))))
    return control, trainers, rollouts


def _same(params, want) -> bool:
    return all(torch.equal(params[n].view(torch.uint8), want[n].view(torch.uint8))
               for n in want)


def _run(options: TransferConfig, num_versions: int = NUM_VERSIONS, *, hook=None, after=None):
    """Trainers send versions 1..n while the engines generate; returns the adapters and, per
    engine, the set of versions seen by its ranks at every step. ``after(shard, engine_rank,
    version)`` is every receiver's after_update_hook."""
    control, trainers, rollouts = _group(options, hook, after=after)
    connect = [threading.Thread(target=a.connect) for _, a in trainers]
    for t in connect:
        t.start()
    for t in connect:
        t.join()
    errors: list[BaseException] = []
    stop = threading.Event()
    engine_done = [False] * ENGINES
    # The barrier's action runs once per step while every rank waits: the ranks of an engine
    # agree on whether to stop (a check after the wait could see another rank's next poll).
    barriers = [threading.Barrier(ENGINE_TP, action=lambda e=e: engine_done.__setitem__(
        e, all(a.version == num_versions for _, a in rollouts if a.engine == e)))
        for e in range(ENGINES)]
    steps: dict[tuple[int, int], set[int]] = {}
    lock = threading.Lock()

    def trainer(shard, adapter):
        try:
            for v in range(1, num_versions + 1):
                with torch.no_grad():
                    shard.load_weights(CHECKPOINTS[v].items())  # the optimizer step
                adapter.send_weights(v)
            if adapter.worker.index == 0 and options.sender_staging:
                adapter.wait_idle()
        except BaseException as e:
            errors.append(e)
            stop.set()

    def rollout(shard, adapter):
        try:
            while not stop.is_set():
                v = adapter.poll_requests()
                if v is not None:
                    assert _same(shard.params, REFERENCE[adapter.engine_rank][v]), \
                        f"{adapter.worker} not bit-exact at version {v}"
                with lock:  # the inference step runs with this version
                    steps.setdefault((adapter.engine, adapter.step), set()).add(adapter.version)
                barriers[adapter.engine].wait(timeout=30)
                if engine_done[adapter.engine]:
                    return
        except threading.BrokenBarrierError:
            if not stop.is_set():
                errors.append(AssertionError(f"{adapter.worker}: engine barrier broke"))
        except BaseException as e:
            errors.append(e)
            stop.set()
            for b in barriers:
                b.abort()

    threads = [threading.Thread(target=trainer, args=tr) for tr in trainers]
    threads += [threading.Thread(target=rollout, args=ro) for ro in rollouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        if errors:
            break
    stop.set()
    for b in barriers:
        b.abort()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return control, trainers, rollouts, steps


def _generate(rollouts, finished, on_step=None) -> None:
    """Every rollout rank on its own thread: poll, then an inference step, then the engine's
    barrier (its collectives); stop once ``finished()``."""
    errors: list[BaseException] = []
    done = [False] * ENGINES
    barriers = [threading.Barrier(ENGINE_TP, action=lambda e=e: done.__setitem__(e, finished()))
                for e in range(ENGINES)]

    def loop(shard, adapter):
        try:
            for _ in range(2000):
                v = adapter.poll_requests()
                if on_step is not None:
                    on_step(shard, adapter, v)
                barriers[adapter.engine].wait(timeout=30)
                if done[adapter.engine]:
                    return
        except threading.BrokenBarrierError:
            if not errors:
                errors.append(AssertionError(f"{adapter.worker}: engine barrier broke"))
        except BaseException as e:
            errors.append(e)
            for b in barriers:
                b.abort()

    threads = [threading.Thread(target=loop, args=ro) for ro in rollouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for b in barriers:
        b.abort()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rollout hung"


def _first(adapter, what: str, version: int) -> int:
    return min(seq for seq, w, v in adapter.events if w == what and v == version)


def _installed(rollouts, what: str = "installed") -> dict[int, list[int]]:
    """Per version, the sequence numbers of the rollouts' ``what`` events ("installed": a poll
    returned it; "in_params": its last byte reached the parameters)."""
    out: dict[int, list[int]] = {}
    for _, a in rollouts:
        for seq, w, v in a.events:
            if w == what:
                out.setdefault(v, []).append(seq)
    return out


MODES = {"sync": (False, False), "ss": (True, False), "rs": (False, True), "async": (True, True)}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_installs_bit_exact_versions_in_order_one_version_per_engine_step(mode):
    ss, rs = MODES[mode]
    hooked, after = [], []
    control, trainers, rollouts, steps = _run(
        TransferConfig(sender_staging=ss, receiver_staging=rs, round_bytes=96 << 10,
                       timeout_s=30), hook=hooked.append,
        after=lambda shard, k, v: after.append((v, _same(shard.params, REFERENCE[k][v]))))
    for (engine, step), versions in steps.items():
        assert len(versions) == 1, f"engine {engine} ran step {step} with versions {versions}"
    for _, a in rollouts:
        got = [v for _, w, v in a.events if w == "installed"]
        assert got == sorted(set(got)) and got[-1] == NUM_VERSIONS, got
        assert a.version == NUM_VERSIONS
    # The hook ran once before every install, with the version announced for it (SS without
    # RS: the transfer may then carry a newer staged version, which poll_requests returns).
    installs = sorted(v for v, seqs in _installed(rollouts).items() for _ in seqs)
    assert len(hooked) == len(installs) and sorted(hooked) <= installs
    # The after-hook ran once per install with the version installed, and found it whole in
    # the parameters (where an engine rebuilds what it derives from its weights).
    assert sorted(v for v, _ in after) == installs and all(whole for _, whole in after), after
    assert control.transport.bytes_written > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_who_waits_for_whom_in_each_mode(mode):
    ss, rs = MODES[mode]
    _, trainers, rollouts, _ = _run(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                   round_bytes=96 << 10, timeout_s=30))
    installed = _installed(rollouts, "in_params")
    joins = [e for _, a in rollouts for e in a.events if e[1] == "join"]
    assert bool(joins) is (not rs), "rollouts join the transfer exactly when RS is off"
    for v, seqs in installed.items():
        if not any(w == "released" and vv == v for _, a in trainers for _, w, vv in a.events):
            continue  # superseded before it was sent
        # "released": the moment send_weights(v) stops waiting (logged by whoever releases it).
        resumed = max(_first(a, "released", v) for _, a in trainers)
        if ss or rs:
            # The trainers go on before any rollout runs the new version.
            assert resumed < min(seqs), (v, resumed, seqs)
        else:
            # Sync: no trainer goes on before every rollout installed it.
            assert len(seqs) == ENGINES * ENGINE_TP and resumed > max(seqs), (v, resumed, seqs)
    if ss:
        for _, a in trainers:  # each release follows its own staging copy
            for _, w, v in a.events:
                if w == "released":
                    assert _first(a, "staged", v) < _first(a, "released", v)


def test_sync_mode_raises_a_clear_timeout_when_rollouts_never_poll():
    control, trainers, _ = _group(TransferConfig(timeout_s=0.5, round_bytes=96 << 10))
    threads = [threading.Thread(target=a.connect) for _, a in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = []

    def send(adapter):
        try:
            adapter.send_weights(1)
        except TimeoutError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=send, args=(a,)) for _, a in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors and any("did not poll_requests()" in e for e in errors), errors


@pytest.mark.parametrize("mode", ["ss", "rs", "async"])
def test_a_rollout_that_stops_polling_does_not_block_the_trainers_and_gets_the_newest(mode):
    ss, rs = MODES[mode]
    control, trainers, rollouts = _group(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                        round_bytes=96 << 10, timeout_s=30))
    threads = [threading.Thread(target=a.connect) for _, a in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = NUM_VERSIONS + 2

    def trainer(shard, adapter):
        for v in range(1, last + 1):
            with torch.no_grad():
                shard.load_weights(CHECKPOINTS[v].items())
            adapter.send_weights(v)   # no rollout polls meanwhile: must not block

    threads = [threading.Thread(target=trainer, args=tr) for tr in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a trainer blocked on rollouts not polling"
    if rs:
        trainers[0][1].wait_idle()
    # Now the engines poll, each rank on its own thread, in lockstep, until they run the newest.
    _generate(rollouts, lambda: all(a.version == last for _, a in rollouts))
    trainers[0][1].wait_idle()
    for shard, a in rollouts:
        assert a.version == last
        assert _same(shard.params, REFERENCE[a.engine_rank][last])
        got = [v for _, w, v in a.events if w == "installed"]
        assert len(got) < last, f"older versions were superseded, not all installed: {got}"


@pytest.mark.parametrize("hook", ["before_update_hook", "after_update_hook"])
def test_a_hook_that_is_not_callable_is_refused_at_construction(hook):
    control, shard = LocalControl(), RolloutShard(CONFIG, ENGINE_TP, 0, 1, 0)
    with pytest.raises(ValueError, match=f"{hook} must be a callable taking the version"):
        ReceiverAdapter(shard.params, shard.load_weights, SPEC, rank=0, engine=0, engine_rank=0,
                        engine_size=ENGINE_TP, control=control, transport=control.transport,
                        **{hook: "engine.refresh"})
