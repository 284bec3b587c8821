"""Ranks of an actor mesh, whatever its axis names: what the controller and its baselines
read answers by and call single actors with.

    checksums = by_rank(rollouts.checksums.call(v).get())   # a list, in flat rank order
    actor_at(trainers, 0).rendezvous.call_one(addr).get()   # one actor of the mesh
"""

from __future__ import annotations


def by_rank(values) -> list:
    """The values of a Monarch ``ValueMesh`` (or any ``{point: value}``), in flat rank order."""
    return [v for _, v in sorted(values.items(), key=lambda kv: kv[0].rank)]


def actor_at(mesh, rank: int):
    """The actor of flat rank ``rank`` of ``mesh`` (any axis names)."""
    return mesh.flatten("rank").slice(rank=rank)
