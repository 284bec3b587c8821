"""A calibrated, event-driven model of one update: the sequencer's steps over fluid-shared links.

The no-overhead model of `simulate` charges each round only its busiest link. This one replays
what an update does (`weightbridge.coordination.sequencer`, `session.ControlSteps`,
`worker.TransferWorker`), with measured costs (`Overheads`, fitted by
`weightbridge.simulation.calibrate`):

    send(r)    issued once round r - depth landed and send(r - 1) was issued; on every trainer,
               in order (one thread serves a trainer's sends): control message, step cost,
               pack (copy; a block-quantizing pack costs the source bytes it reads),
               checksum, issue its writes, wait until they landed, reply
    forward(r) EXTERNAL then INTERNAL, on every rollout once every reply of the step before
               came back: message, step cost, checksum, writes, reply
    land(r)    on every rollout: message, step cost, checksum what arrived, assemble (copy),
               reply

The controller sends its messages one at a time, ``Overheads.stagger_s`` each, in the order it
issues them across all steps (a trainer's send of round r+1 may queue behind the forward of
round r); each arrives ``control_s`` after it left. A step waits for every worker taking part:
it has all their answers ``Overheads.fanout_s`` per worker after the last one left (the
controller hears them one after another).

With `Cluster.shared_cpus` (the emulated cluster: every proc on one machine's cores) the
workers' step costs, checksums, copies and write issues, and the controller's sends, share
those cores fairly, each proc one core at most (one thread at a time: its GIL). Without it
each of those costs is a plain delay.

Links are shared max-min fairly (TCP-like) by the writes in flight: each worker's NIC
(`Cluster.gpu_nic_bandwidth`) and each node's link (`Cluster.inter_node_bandwidth`), both
scaled by `Overheads.link_efficiency`, one direction each; INTERNAL writes use NVLink
(`Cluster.intra_node_bandwidth` per worker, each direction). A shaped link with a token
bucket (`Cluster.link_burst_bytes`, the emulated cluster's `tc tbf`) sends that many bytes
unshaped after idling (`weightbridge.simulation.fluid`). EWTT runs from the first pack to
the last assemble (or write), as `controller.timing` measures it.

Typical usage::

    est = simulate(plan, cluster, overheads=Overheads(control_s=2e-3, copy_bandwidth=2e9),
                   depth=3)
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from weightbridge.simulation.fluid import FluidNetwork
from weightbridge.planning.route import EXTERNAL, INTERNAL, RECEIVE
from weightbridge.types import QUANT_DTYPE, dtype_itemsize


_CPU_TIMES = ("control_s", "step_s", "write_s", "copy_fixed_s", "fanout_s", "stagger_s")
"""`Overheads` fields that are a CPU's time (`Overheads.on_slower_cores`)."""
_CPU_RATES = ("copy_bandwidth", "checksum_bandwidth")
"""`Overheads` fields that are a CPU's rate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Overheads:
    """Measured costs of the steps of an update (all default to none: zero or infinite rate).

    Example (fitted on the emulated cluster, 2 loaded cores): ``Overheads(control_s=3e-3,
    step_s=1e-3, write_s=2e-3, copy_fixed_s=1e-3, copy_bandwidth=1.5e9,
    checksum_bandwidth=3e9, link_efficiency=0.95)``
    """

    control_s: float = 0.0
    """One-way latency of a control message between the sequencer and a worker."""
    step_s: float = 0.0
    """Fixed cost of serving one step on a worker (dispatch, bookkeeping)."""
    write_s: float = 0.0
    """Cost of issuing one write, paid one after another by the writer before bytes flow."""
    copy_fixed_s: float = 0.0
    """Fixed cost of one pack or assemble (a kernel launch and its table)."""
    copy_bandwidth: float = math.inf
    """Bytes per second a pack or an assemble moves."""
    checksum_bandwidth: float = math.inf
    """Bytes per second of the writers' and receivers' checksums (inf: checksums off)."""
    link_efficiency: float = 1.0
    """Goodput over nominal rate of every RDMA link, with one write on it."""
    flow_penalty: float = 0.0
    """Goodput lost per further write in flight on an RDMA link: with n writes on it a link
    carries ``rate * link_efficiency / (1 + flow_penalty * (n - 1))`` (streams competing in
    one queue, and the CPU each stream costs, on the emulated cluster)."""
    fanout_s: float = 0.0
    """Cost per worker a step waits for: a step on n workers has all its answers
    ``fanout_s * n`` after the last one left its worker (the controller reaches and hears
    the workers one after another; `benchmarks/control_scaling.py` measures it)."""
    stagger_s: float = 0.0
    """How long the controller takes to send one message: it sends one at a time, in the
    order it issues them across all steps, so the k-th message queued behind others leaves
    ``k * stagger_s`` after the first (measured as the spread of a step's start times)."""

    def __post_init__(self) -> None:
        bad = [n for n in ("control_s", "step_s", "write_s", "copy_fixed_s", "flow_penalty",
                            "fanout_s", "stagger_s")
               if not getattr(self, n) >= 0]
        bad += [n for n in ("copy_bandwidth", "checksum_bandwidth") if not getattr(self, n) > 0]
        if not 0 < self.link_efficiency <= 1:
            bad.append("link_efficiency")
        if bad:
            raise ValueError(f"{self}: {bad} out of range; times must be >= 0, rates > 0 and "
                             f"link_efficiency in (0, 1]")

    def on_slower_cores(self, factor: float) -> Overheads:
        """These costs on cores ``factor`` times slower (below 1: faster): every cost a CPU
        pays (control messages, steps, write issues, copies, checksums, the controller's
        sends and fan-in) takes ``factor`` times as long; the links' efficiency and the cost
        of sharing them do not change.

        Example: fitted while a probe timed a fixed piece of work at 0.66 ms, predicted
        where it took 0.73 ms: ``overheads.on_slower_cores(0.73 / 0.66)``.
        """
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"factor must be a positive finite ratio of two cores' speeds, "
                             f"got {factor}")
        return replace(self, **{n: getattr(self, n) * factor for n in _CPU_TIMES},
                       **{n: getattr(self, n) / factor for n in _CPU_RATES})


def timeline_ewtt(plan, cluster, overheads: Overheads, depth: int) -> float:
    """EWTT (seconds) of one update of ``plan`` on ``cluster`` with ``overheads``."""
    if depth < 2:
        raise ValueError(f"depth must be >= 2 round arenas per worker, got {depth}")
    if plan.num_rounds == 0:
        return 0.0
    return _Update(plan, cluster, overheads, depth).run()


class _Update:
    """The sequencer of one update as callbacks on a clock (see the module doc). Every
    callback runs at its own time (``self.now``)."""

    def __init__(self, plan, cluster, oh: Overheads, depth: int):
        self.oh, self.depth, self.num_rounds = oh, depth, plan.num_rounds
        self.num_trainers = len(plan.trainers)
        self.W = self.num_trainers + len(plan.rollouts)
        places = list(plan.trainers) + list(plan.rollouts)
        nodes = {n: k for k, n in enumerate(dict.fromkeys(p.node for p in places))}
        self.node = [nodes[p.node] for p in places]
        self.N = len(nodes)
        # resources: [worker NIC out, worker NIC in, node out, node in, NVLink out, NVLink in,
        # unlimited]; the RDMA ones (the first 2W + 2N) pay the flow penalty and may burst
        rdma = oh.link_efficiency
        shaped = np.arange(4 * self.W + 2 * self.N + 1) < 2 * self.W + 2 * self.N
        self.net = FluidNetwork(np.concatenate([
            np.full(2 * self.W, cluster.gpu_nic_bandwidth * rdma),
            np.full(2 * self.N, cluster.inter_node_bandwidth * rdma),
            np.full(2 * self.W, cluster.intra_node_bandwidth), [math.inf]]),
            shaped, oh.flow_penalty, burst=shaped * float(cluster.link_burst_bytes))
        self.unlimited = 4 * self.W + 2 * self.N
        # CPU: a worker serves its steps on one thread at a time (the GIL: capacity 1 each),
        # and so does the controller (index W); with shared cores, all their threads share
        # them (index W + 1), processor-sharing fairly
        self.cpus = None
        if cluster.shared_cpus:
            self.cpus = FluidNetwork(np.concatenate([np.ones(self.W + 1),
                                                     [cluster.shared_cpus]]),
                                     np.zeros(self.W + 2, dtype=bool), 0.0)
        self.steps = plan_steps(plan)
        self.active = {(r, stage) for (_, r, stage) in self.steps if stage != "land"}
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.outbox: collections.deque = collections.deque()  # the controller's messages
        self.first_start = math.inf
        self.last_end = 0.0
        self.queue: list[list] = [[] for _ in range(self.num_trainers)]
        self.busy = [False] * self.num_trainers
        self.landed = [False] * self.num_rounds
        self.issued = [False] * self.num_rounds

    # -- the clock ------------------------------------------------------------------------------

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.heap, (t, self.seq, fn))
        self.seq += 1

    def run(self) -> float:
        self.maybe_send(0)
        nets = [self.net] + ([self.cpus] if self.cpus else [])
        while self.heap or any(n.flows for n in nets):
            t_net = self.now + min(n.next_event() for n in nets)
            timed = bool(self.heap) and self.heap[0][0] <= t_net
            t = self.heap[0][0] if timed else t_net
            fn = heapq.heappop(self.heap)[2] if timed else None
            done = [cb for n in nets for cb in n.advance(t - self.now)]
            self.now = t
            for cb in done:
                cb()
            if fn is not None:
                fn()
        assert all(self.landed), "the model left rounds unlanded"
        return self.last_end - self.first_start

    def cpu(self, w: int, seconds: float, then) -> None:
        """``then()`` once worker ``w`` (``W``: the controller) has had ``seconds`` of CPU: at
        once on its own core, or (`Cluster.shared_cpus`) its fair share of the cores all
        procs share."""
        if self.cpus is None or seconds <= 0:
            self.at(self.now + seconds, then)
        else:
            self.cpus.add((w, self.W + 1), seconds, then)

    def send(self, then) -> None:
        """The controller sends a message, which arrives ``control_s`` later: ``then()``.
        It sends one at a time, ``stagger_s`` of its CPU each: a message waits for those
        before it."""
        self.outbox.append(then)
        if len(self.outbox) == 1:
            self._send_first()

    def _send_first(self) -> None:
        self.at(self.now + self.oh.control_s, self.outbox[0])  # it leaves now
        self.cpu(self.W, self.oh.stagger_s, self._sent)

    def _sent(self) -> None:
        self.outbox.popleft()
        if self.outbox:
            self._send_first()

    def step(self, w: int, seconds: float, then) -> None:
        """A control message to worker ``w``, which serves it with ``seconds`` of CPU, then
        ``then()``."""
        self.send(partial(self.cpu, w, seconds, then))

    def reply(self, join: "_Join") -> None:
        """A worker's answer reaches the sequencer ``control_s`` later."""
        self.at(self.now + self.oh.control_s, join.arrive)

    def join(self, count: int, then) -> "_Join":
        """Calls ``then`` ``fanout_s * count`` after the ``count``-th answer came in."""
        if not self.oh.fanout_s:
            return _Join(count, then)
        delay = self.oh.fanout_s * count
        return _Join(count, lambda: self.at(self.now + delay, then))

    # -- the sequencer --------------------------------------------------------------------------

    def maybe_send(self, r: int) -> None:
        """send(r) once round r - depth landed and send(r - 1) was issued."""
        if (r >= self.num_rounds or self.issued[r] or (r >= self.depth and not
                                                        self.landed[r - self.depth])
                or (r > 0 and not self.issued[r - 1])):
            return
        self.issued[r] = True
        if (r, RECEIVE) not in self.active:
            self.forward(r, EXTERNAL)
            self.maybe_send(r + 1)
            return
        replies = self.join(self.num_trainers, lambda: self.forward(r, EXTERNAL))
        for i in range(self.num_trainers):
            self.send(partial(self.enqueue, i, r, replies))
        self.maybe_send(r + 1)

    def enqueue(self, i: int, r: int, replies: "_Join") -> None:
        """A trainer serves its sends one at a time, in arrival order."""
        self.queue[i].append((r, replies))
        if not self.busy[i]:
            self.serve(i)

    def serve(self, i: int) -> None:
        oh = self.oh
        r, replies = self.queue[i].pop(0)
        self.busy[i] = True
        work = oh.step_s
        pack, writes = self.steps.get((i, r, RECEIVE), (0, ()))
        if pack:
            self.first_start = min(self.first_start, self.now + oh.step_s)
            work += oh.copy_fixed_s + pack / oh.copy_bandwidth

        def done() -> None:
            self.busy[i] = False
            self.reply(replies)
            if self.queue[i]:
                self.serve(i)
        self.cpu(i, work, partial(self.write, i, writes, done))

    def forward(self, r: int, stage: int) -> None:
        then = ((lambda: self.forward(r, INTERNAL)) if stage == EXTERNAL else
                (lambda: self.land(r)))
        if (r, stage) not in self.active:  # the sequencer issues only steps with writes
            then()
            return
        replies = self.join(self.W - self.num_trainers, then)
        for j in range(self.num_trainers, self.W):
            _, writes = self.steps.get((j, r, stage), (0, ()))
            self.step(j, self.oh.step_s,
                      partial(self.write, j, writes, partial(self.reply, replies)))

    def land(self, r: int) -> None:
        oh = self.oh

        def landed() -> None:
            self.landed[r] = True
            self.maybe_send(r + self.depth)
        replies = self.join(self.W - self.num_trainers, landed)
        for j in range(self.num_trainers, self.W):
            received = self.steps.get((j, r, "land"), 0)
            work = oh.step_s
            if received:
                work += (received / oh.checksum_bandwidth + oh.copy_fixed_s
                         + received / oh.copy_bandwidth)
            self.step(j, work, partial(self.assembled, bool(received), replies))

    def assembled(self, received: bool, replies: "_Join") -> None:
        if received:
            self.last_end = max(self.last_end, self.now)
        self.reply(replies)

    def write(self, w: int, writes, done) -> None:
        """Checksum and issue worker ``w``'s ``writes`` [(stage, dst, bytes)]; ``done()``
        once all landed (at once when there are none)."""
        if not writes:
            self.at(self.now, done)
            return
        oh = self.oh
        total = sum(n for _, _, n in writes)
        left = [len(writes)]

        def landed() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.last_end = max(self.last_end, self.now)
                done()

        def begin() -> None:
            for stage, dst, nbytes in writes:
                self.net.add(self.resources(stage, w, dst), nbytes, landed)
        self.cpu(w, total / oh.checksum_bandwidth + oh.write_s * len(writes), begin)

    def resources(self, stage: int, src: int, dst: int) -> tuple[int, ...]:
        W, N = self.W, self.N
        if stage == INTERNAL:
            return (2 * W + 2 * N + src, 3 * W + 2 * N + dst, self.unlimited, self.unlimited)
        return (src, W + dst, 2 * W + self.node[src], 2 * W + N + self.node[dst])


class _Join:
    """Calls ``then()`` when the ``count``-th arrival comes in."""

    def __init__(self, count: int, then):
        self.left, self.then = count, then

    def arrive(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.then()


def plan_steps(plan) -> dict:
    """(worker, round, stage) -> (bytes packed, [(stage, dst, bytes)] one write per peer);
    (rollout, round, "land") -> bytes received. From the plan's tables, no worker plans."""
    t = plan.tables
    rnd, nbytes = t.round, t.nbytes.astype(np.int64)
    out: dict = {}
    # one write per (src, dst, stage, round): the executor merges contiguous ranges per peer
    order = np.lexsort((t.dst, t.src, t.stage, rnd))
    merged: dict = {}
    for d in order.tolist():
        k = (int(t.src[d]), int(rnd[d]), int(t.stage[d]), int(t.dst[d]))
        merged[k] = merged.get(k, 0) + int(nbytes[d])
    for (src, r, stage, dst), n in merged.items():
        entry = out.setdefault((src, r, stage), [0, []])
        entry[1].append((stage, dst, n))
        out[(dst, r, "land")] = out.get((dst, r, "land"), 0) + n
    packed = np.flatnonzero(t.stage == RECEIVE)
    cost = _pack_bytes(plan)[t.seg[packed]]
    for src, r, n in zip(t.src[packed].tolist(), rnd[packed].tolist(), cost.tolist()):
        out[(src, r, RECEIVE)][0] += n
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in out.items()}


def _pack_bytes(plan) -> np.ndarray:
    """[S] bytes a pack of each segment costs at `Overheads.copy_bandwidth`: its buffer bytes,
    except that a block-quantizing pack reads each element of a value overlap twice in the
    trainers' dtype (amax, then values) and the elements of every block of a scale overlap
    once."""
    t = plan.tables
    cost = t.seg_bytes.astype(np.float64)
    overlaps = plan.correspondence.overlaps
    if not any(o.block for o in overlaps):
        return cost
    quantized = {i for i, o in enumerate(overlaps) if o.block}
    for seg in np.flatnonzero(np.isin(t.seg_group, [g for g, members in
                                                     enumerate(t.group_overlaps)
                                                     if quantized & set(members.tolist())])):
        total = 0.0
        for chunk, _ in plan.placed_chunks(int(seg)):
            o = overlaps[chunk.overlap]
            if not o.block:
                total += chunk.count * dtype_itemsize(o.dtype)
                continue
            source = dtype_itemsize(o.source_dtype or o.dtype)
            per = 2 * source if o.dtype == QUANT_DTYPE else math.prod(o.block) * source
            total += chunk.count * per
        cost[seg] = total
    return cost
