"""Engines joining and leaving a connected group, for every path (the controller's
`MeshTransfer.add_engine` / `remove_engine`, the adapters' `add_engines` / `remove_engine`).

    join_group(control, maps, group, config)
        CONFIG, SOURCE_MAP on the joining workers only -> same config? same checkpoint?
        right engines?
        extend_plan (weightbridge.planning.extend): mirrored on a live replica, or appended
        SETUP on the joining workers (register) and on the workers whose part changed
        (trainers: again; forwarders: new writes only), SET_PEERS on them
    leave_group(control, group, config, leaving)
        shrink_plan: drop the rows of an engine nothing depends on; forwarders rewired
        (None: the caller re-plans with `session.plan_group`)

Typical usage::

    maps, group, first = join_group(control, maps, group, config)
    run_update(control, group, first_round=first)      # the joining engine's weights
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, PeerCall, rollouts
from weightbridge.coordination.sequencer import active_steps
from weightbridge.coordination.session import (ConnectedGroup, GroupMaps, check_configs,
                                               check_engines, check_same_checkpoint,
                                               plan_group, set_peers, source_maps)
from weightbridge.execution.executor import incoming_ranges, outgoing_ranges
from weightbridge.planning.extend import extend_plan, rewired, shrink_plan
from weightbridge.types import WorkerId


def join_group(control: ControlPlane, maps: GroupMaps, group: ConnectedGroup,
               config: TransferConfig, *, generation: int = 0, restricted: bool = False,
               excluded: frozenset[int] = frozenset(),
               excluded_trainers: frozenset[int] = frozenset()
               ) -> tuple[GroupMaps, ConnectedGroup, int]:
    """Plan in the rollout workers ``control`` has beyond ``maps`` (engines that joined,
    `TransferGroup.add_engines`): probe only them, extend the plan in force for them
    (`extend_plan`), set up only them and the workers whose part changed.

    A replica of a live engine is mirrored on it: the trainers are untouched and the rollouts
    that land segments from them forward one more copy, taking only their new writes (their
    buffers, registered ranges and handles stay); every other worker is untouched. Another
    layout gets rounds of its own appended, and the trainers are set up again. Returns the
    grown maps, the grown group and the first round the joining workers take part in:
    ``run_update(..., first_round=...)`` moves the trainers' weights into them (alone, when
    their rounds were appended; 0: a whole update, the others' bytes unchanged).

    ``restricted``: the plan in force moves only some tensors (a delta update's): a joining
    engine needs them all, so the whole group is planned again for every tensor (`plan_group`
    with ``excluded`` and ``excluded_trainers``) and every live worker set up.

    Raises:
        ValueError: a joining worker in the wrong engine; nothing joined.
        LayoutError: a joining worker reads another checkpoint, or needs elements no live
            trainer holds; either way before any buffer exists.
    """
    joining = rollouts(control)[len(maps.rollouts):]
    if not joining:
        raise ValueError("no rollout engine joined since the plan was made: grow the group "
                         "first (TransferGroup.add_engines on meshes, or add the engines' "
                         "workers to the control plane)")
    check_configs(control, config, joining)  # (before the probe, as at connect)
    found, _ = source_maps(control, joining)
    check_engines(control, [placement for _, placement, _ in found], first=joining[0].index)
    check_same_checkpoint([maps.spec], [spec for _, _, spec in found],
                          first=joining[0].index)
    pairs = tuple((smap, placement) for smap, placement, _ in found)
    grown = dataclasses.replace(maps, rollouts=maps.rollouts + pairs)
    if restricted:
        return grown, plan_group(control, grown, config, excluded=excluded,
                                 excluded_trainers=excluded_trainers, generation=generation), 0
    plan = extend_plan(group.plan, pairs)
    changed, new = rewired(group.plan, plan)
    assert new == joining, (new, joining)
    plans = plan.worker_plans(changed + joining)
    ranges = incoming_ranges(plans.values(), config.depth)
    found = control.call_each(joining, PeerCall.SETUP, [
        (plans[w], sorted(ranges.get(w, ())), generation) for w in joining])
    handles = {**group.handles,
               **{(w, key): h for w, hs in zip(joining, found) for key, h in hs.items()}}
    # Trainers with appended rounds are set up again; rollouts that forward to the joining
    # engine only take their new writes (their buffers and registered ranges stay).
    control.call_each(changed, PeerCall.SETUP, [
        (plans[w],) if w.side == "trainer" else (plans[w], None) for w in changed])
    set_peers(control, {w: outgoing_ranges(plans[w], config.depth) for w in changed + joining},
              handles, config)
    appended = plan.num_rounds > group.plan.num_rounds
    return grown, dataclasses.replace(
        group, plan=plan, active=group.active | active_steps(plans.values()),
        live_rollouts=group.live_rollouts + tuple(joining), num_handles=len(handles),
        handles=handles), group.plan.num_rounds if appended else 0


def leave_group(control: ControlPlane, group: ConnectedGroup, config: TransferConfig,
                leaving: Sequence[WorkerId]) -> ConnectedGroup | None:
    """Take the rollout workers ``leaving`` (whole engines) out of the plan in force when no
    other worker depends on them (`shrink_plan`: an engine that was mirrored in by a join):
    only the workers that forwarded to them take new writes, nobody else is set up again.
    None when some segment is landed or relayed by them: plan the group again (`plan_group`
    with them excluded)."""
    shrunk = shrink_plan(group.plan, [w.index for w in leaving])
    if shrunk is None:
        return None
    plan, writers = shrunk
    plans = plan.worker_plans(writers)
    control.call_each(writers, PeerCall.SETUP, [(plans[w], None) for w in writers])
    gone = set(leaving)
    handles = {k: h for k, h in group.handles.items() if k[0] not in gone}
    set_peers(control, {w: outgoing_ranges(plans[w], config.depth) for w in writers},
              handles, config)
    return dataclasses.replace(
        group, plan=plan, live_rollouts=tuple(w for w in group.live_rollouts if w not in gone),
        num_handles=len(handles), handles=handles)


def check_removable(engine, num_engines: int, out: Collection[int]) -> None:
    """Raise ValueError unless ``engine`` can leave: an engine number of the group, not out
    yet (``out``), not the last one in."""
    if isinstance(engine, bool) or not isinstance(engine, int) or not 0 <= engine < num_engines:
        raise ValueError(f"engine must be an engine number in [0, {num_engines}), got "
                         f"{engine!r} (an int; a bool or a float is not one)")
    if engine in out:
        raise ValueError(f"engine {engine} is already out of this group (out: {sorted(out)})")
    if len(out) + 1 == num_engines:
        raise ValueError(f"engine {engine} is the last engine of this group; close the group "
                         f"instead")
