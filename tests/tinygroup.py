"""A tiny model for in-process adapter tests: rounds of odd byte counts, whole-model ranks.

Three tensors (3 bf16, 5 fp32 and 4 x 6 bf16 elements: no round is a multiple of 8 bytes);
every trainer and every rollout holds the whole model (data-parallel trainers, an engine per
rollout by default), all on one `LocalControl`.

Typical usage::

    control, trainers, rollouts = build(TransferConfig(timeout_s=5))
    connect(trainers)
    in_threads(*send(trainers, 1, ss=False), *[lambda a=a: a.wait_for_version(1)
                                                for _, a in rollouts])
"""

import threading

import torch

from weightbridge import CheckpointSpec, ReceiverAdapter, SenderAdapter, TransferConfig
from weightbridge.coordination.local_control import LocalControl

SHAPES = {"w": ((3,), torch.bfloat16), "v": ((5,), torch.float32), "m": ((4, 6), torch.bfloat16)}
MODES = {"sync": (False, False), "ss": (True, False), "rs": (False, True), "async": (True, True)}


def checkpoint(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + version)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, dtype) in SHAPES.items()}


SPEC = CheckpointSpec.from_tensors(checkpoint(0))


class Model:
    """One rank's copy of the whole model (both sides hold every tensor)."""

    def __init__(self):
        self.params = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in SHAPES.items()}
        self.load_weights(checkpoint(0).items())

    def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, t in weights:
                self.params[name].copy_(t)

    def holds(self, version: int) -> bool:
        return all(torch.equal(p.view(torch.uint8), checkpoint(version)[n].view(torch.uint8))
                   for n, p in self.params.items())

    def mark(self) -> None:
        """Remember the bytes held now (after connect a rollout holds the probe's values)."""
        self._marked = {n: p.clone() for n, p in self.params.items()}

    def unchanged(self) -> bool:
        """No byte changed since `mark`."""
        return all(torch.equal(p.view(torch.uint8), self._marked[n].view(torch.uint8))
                   for n, p in self.params.items())


class PaddedModel(Model):
    """A trainer's copy whose ``m`` has one padding row (a vocabulary padded for its shards):
    row 4 is an element no checkpoint element lands in."""

    def __init__(self):
        self.params = {n: torch.zeros((shape[0] + (n == "m"), *shape[1:]), dtype=dtype)
                       for n, (shape, dtype) in SHAPES.items()}
        self.load_weights(checkpoint(0).items())

    def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, t in weights:
                self.params[name][:t.shape[0]].copy_(t)


def build(config: TransferConfig, *, num_trainers: int = 2, num_engines: int = 2,
          sizes: tuple[int, ...] | None = None, transport=None, sender_cls=None,
          trainer_model=None):
    """(control, [(model, sender)], [(model, receiver)]); ``sizes``: each rollout's own
    engine_size (default: 1 each, an engine per rollout); ``transport(control)`` replaces
    the control's `LocalTransport` and ``sender_cls(rank)`` a trainer's adapter class (tests
    inject faults this way); ``trainer_model`` the trainers' model class (`PaddedModel`)."""
    control = LocalControl()
    if transport is not None:
        control.transport = transport(control)
    trainers = []
    for i in range(num_trainers):
        # (Looked up at the call: tests patch tinygroup.Model to move every model's parameters.)
        m = (trainer_model or Model)()
        cls = SenderAdapter if sender_cls is None else sender_cls(i)
        trainers.append((m, control.add(cls(
            m.params, m.load_weights, SPEC, rank=i, control=control,
            transport=control.transport, config=config))))
    rollouts = []
    for j, size in enumerate(sizes or (1,) * num_engines):
        m = Model()
        rollouts.append((m, control.add(ReceiverAdapter(
            m.params, m.load_weights, SPEC, rank=j, engine=j // size, engine_rank=j % size,
            engine_size=size, control=control, transport=control.transport, config=config))))
    return control, trainers, rollouts


def in_threads(*calls) -> list:
    """Run each call in a thread; their results (an exception in place of a result)."""
    out = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001  (returned to the test)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    return out


def connect(trainers) -> None:
    assert in_threads(*[a.connect for _, a in trainers]) == [None] * len(trainers)


def send(trainers, version: int, *, ss: bool):
    """One trainer step and send_weights on every trainer (rank 0 waits out SS transfers)."""
    def one(model, adapter):
        model.load_weights(checkpoint(version).items())
        adapter.send_weights(version)
        if ss and adapter.worker.index == 0:
            adapter.wait_idle()
    return [lambda m=m, a=a: one(m, a) for m, a in trainers]
