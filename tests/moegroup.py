"""The tiny Qwen3-MoE group on the adapters, in one process: two TP trainers, two engines of TP 2.

Trainer and rollout workers are threads; `LocalControl` stands in for actor endpoints and
`LocalTransport` for RDMA writes. Shared by the adapter tests (test_adapters, test_adapters_delta,
test_fail_closed, test_cuda_path) so no test module imports another.
"""

import threading

import torch
from tinygroup import connect

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (Placement, ReceiverAdapter, SenderAdapter, TransferConfig,
                         extract_source_map, plan_transfer)
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


def group(options: TransferConfig, hook=None, receiver_cls=lambda rank: ReceiverAdapter,
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


def same_bits(params, want) -> bool:
    return all(torch.equal(params[n].view(torch.uint8), want[n].view(torch.uint8))
               for n in want)


def run_versions(options: TransferConfig, num_versions: int = NUM_VERSIONS, *, hook=None,
                 after=None):
    """Trainers send versions 1..n while the engines generate; returns the adapters and, per
    engine, the set of versions seen by its ranks at every step. ``after(shard, engine_rank,
    version)`` is every receiver's after_update_hook."""
    control, trainers, rollouts = group(options, hook, after=after)
    connect(trainers)
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
                    assert same_bits(shard.params, REFERENCE[adapter.engine_rank][v]), \
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


def generate(rollouts, finished, on_step=None) -> None:
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


def first_event(adapter, what: str, version: int) -> int:
    return min(seq for seq, w, v in adapter.events if w == what and v == version)


def events_by_version(rollouts, what: str = "installed") -> dict[int, list[int]]:
    """Per version, the sequence numbers of the rollouts' ``what`` events ("installed": a poll
    returned it; "in_params": its last byte reached the parameters)."""
    out: dict[int, list[int]] = {}
    for _, a in rollouts:
        for seq, w, v in a.events:
            if w == what:
                out.setdefault(v, []).append(seq)
    return out


MODES = {"sync": (False, False), "ss": (True, False), "rs": (False, True), "async": (True, True)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probed_workers(trainer_dtype, rollout_dtype, ckpt_dtype=None):
    """TP2 x EP2 trainers, two TP2 engines, probed against the checkpoint of ``ckpt_dtype``
    (the trainers' dtype unless given)."""
    spec = checkpoint_spec(CONFIG, dtype_name(ckpt_dtype or trainer_dtype))
    trainers = [TrainerShard(CONFIG, 2, r % 2, 2, r // 2, dtype=trainer_dtype) for r in range(4)]
    rollouts = [RolloutShard(CONFIG, 2, r, 1, 0, dtype=rollout_dtype)
                for _ in range(2) for r in range(2)]
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rmaps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    plan = plan_transfer([(m, Placement("t0")) for m in tmaps],
                         [(m, Placement(f"r{i // 2}", engine=i // 2)) for i, m in enumerate(rmaps)],
                         round_bytes=64 << 10)
    return spec, trainers, rollouts, rmaps, plan


def replica_plan(trainers, rollouts, round_bytes, spec):
    """Trainers and two engines, the second a replica of the first (probed once): the plan
    and the first engine's maps."""
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    per_engine = len(rollouts) // 2
    probed = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts[:per_engine]]
    rmaps = probed + probed  # the second engine is a replica of the first
    return plan_transfer([(m, Placement("t0")) for m in tmaps],
                         [(m, Placement(f"r{i // per_engine}", engine=i // per_engine))
                          for i, m in enumerate(rmaps)], round_bytes=round_bytes), probed
