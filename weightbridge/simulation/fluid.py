"""Flows over capacity-limited resources, shared max-min fairly, for the update model.

A flow is some bytes crossing a few resources (a worker's NIC out, the destination's NIC in,
the two nodes' links, or NVLink out and in); every resource has a capacity in bytes/s, and an
unlimited one (inf) pads the shorter lists. The rates are recomputed by progressive filling
whenever a flow starts or ends, or a token bucket runs dry.

A shaped link may hold a token bucket (``burst`` bytes), as `tc tbf` shapes the emulated
cluster's links: after idling it sends up to ``burst`` bytes unshaped, then its rate. The
bucket refills at the link's rate while the link is idle or bursting below its rate; a busy
link whose bucket ran dry keeps it empty (the kernel spends each token as it arrives).

Typical usage::

    net = FluidNetwork(capacity, penalized, penalty=0.02, burst=buckets)
    net.add((0, 5, 8, 11), 65536, on_done)
    dt = net.next_event()
    for on_done in net.advance(dt): on_done()
"""

from __future__ import annotations

import math

import numpy as np

UNSHAPED = 1e12
"""Bytes/s of a shaped link while its bucket holds tokens (the veth under the tbf is a copy)."""


class FluidNetwork:
    """Flows over resources (see the module doc); every flow lists the same number of them."""

    def __init__(self, capacity: np.ndarray, penalized: np.ndarray, penalty: float,
                 burst: np.ndarray | None = None):
        self.capacity = capacity.astype(np.float64)
        self.penalized, self.penalty = penalized, penalty
        self.burst = (np.zeros(len(capacity)) if burst is None
                      else burst.astype(np.float64))
        self.tokens = self.burst.copy()
        self.shaped = self.burst > 0
        self.refill = np.where(self.shaped, self.capacity, 0.0)  # bytes/s into each bucket
        self.flows: dict[int, list] = {}  # id -> [resources, remaining bytes, on_done]
        self.rate: dict[int, float] = {}
        self.used = np.zeros(len(capacity))  # bytes/s through each resource
        self.next_id = 0

    def add(self, resources: tuple[int, ...], nbytes: float, on_done) -> None:
        self.flows[self.next_id] = [resources, float(nbytes), on_done]
        self.next_id += 1
        self._rates()

    def next_event(self) -> float:
        """Seconds until a flow finishes or a bucket runs dry at current rates (inf: none)."""
        finish = min((f[1] / self.rate[i] for i, f in self.flows.items()), default=math.inf)
        draining = (self.tokens > 0) & (self.used > self.capacity)
        if draining.any():
            finish = min(finish, float((self.tokens[draining] / (
                self.used[draining] - self.capacity[draining])).min()))
        return finish

    def advance(self, dt: float) -> list:
        """Move every flow and bucket ``dt`` seconds on; the callbacks of the flows that
        finished."""
        shaped = self.shaped
        if shaped.any():
            idle_or_bursting = shaped & ((self.used == 0) | (self.tokens > 0))
            net_in = self.refill - self.used
            filled = self.tokens + net_in * dt
            # A bucket due to run dry within a picosecond of dt is dry now: the clock cannot
            # step by less than its own rounding, and an unshaped burst drains in nanoseconds.
            filled[(filled <= 1e-9 * self.burst) | (filled <= -net_in * 1e-12)] = 0.0
            self.tokens = np.where(idle_or_bursting, np.clip(filled, 0.0, self.burst),
                                   self.tokens)
        dry = shaped & (self.tokens == 0) & (self.used > self.capacity)
        done = []
        for i, f in list(self.flows.items()):
            f[1] -= self.rate[i] * dt
            if f[1] <= 1e-6 * max(1.0, self.rate[i] * 1e-9):
                done.append(f[2])
                del self.flows[i]
        if done or dry.any():
            self._rates()
        return done

    def _rates(self) -> None:
        """Progressive filling: raise every unfrozen flow's rate until a resource saturates."""
        ids = list(self.flows)
        if not ids:
            self.rate = {}
            self.used = np.zeros(len(self.capacity))
            return
        res = np.array([self.flows[i][0] for i in ids], dtype=np.int64)
        left = np.where(self.tokens > 0, UNSHAPED, self.capacity)
        if self.penalty:
            count = np.bincount(res.ravel(), minlength=len(left))
            left /= 1 + self.penalty * np.maximum(count - 1, 0) * self.penalized
        limited = np.isfinite(left)
        capacity = left.copy()
        rate = np.zeros(len(ids))
        live = np.ones(len(ids), dtype=bool)
        level = 0.0
        while live.any():
            count = np.bincount(res[live].ravel(), minlength=len(left))
            used = count > 0
            share = np.full(len(left), math.inf)
            share[used] = left[used] / count[used]
            step = share.min()
            if not math.isfinite(step):  # the live flows cross only unlimited resources
                raise AssertionError("a flow crosses no limited resource")
            level += step
            left[used] -= step * count[used]
            # An unlimited resource (inf capacity) never saturates: inf - x <= inf is no test.
            full = used & limited & (left <= 1e-9 * capacity)
            hit = live & full[res].any(1)
            rate[hit] = level
            live &= ~hit
        self.rate = dict(zip(ids, rate.tolist()))
        self.used = np.bincount(res.ravel(), weights=np.repeat(rate, res.shape[1]),
                                minlength=len(left))
