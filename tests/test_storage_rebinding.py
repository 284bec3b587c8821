"""A trainer whose parameter storage was rebound is refused at its next send (issue 44, item 4).

Frameworks rebind a parameter's storage (``p.data = new``, ``load_state_dict(assign=True)``,
resharding wrappers). The copy tables built at connect read the registered storage, so a
rebound parameter's new values were never sent: the rollouts kept the connect-time bytes
under every later label, with checksums on. Every send now checks each registered
parameter's data pointer, shape, strides and dtype first and raises `ParameterRebound`
naming it, before any byte moves. In one process (`LocalControl`, two data-parallel
trainers); the controller's path is in tests/test_controller_modes.py.
"""

import pytest
from tinygroup import MODES, build, checkpoint, connect, in_threads, send

from weightbridge import ParameterRebound, TransferConfig


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rebound_parameter_is_refused_by_name_before_any_byte_moves(mode):
    ss, rs = MODES[mode]
    _, trainers, rollouts = build(TransferConfig(timeout_s=5, sender_staging=ss,
                                                 receiver_staging=rs), num_engines=1)
    connect(trainers)
    model, r0 = rollouts[0]
    waits = not rs  # (sync, SS: the trainers wait for the rollouts' polls)
    got = in_threads(*send(trainers, 1, ss=ss), *([lambda: r0.wait_for_version(1)] * waits))
    assert got == [None, None] + [1] * waits, got
    assert r0.wait_for_version(1) == 1 and model.holds(1)
    for m, _ in trainers:  # the next train step rebinds one parameter's storage
        m.params["m"].data = checkpoint(2)["m"].clone()
    got = in_threads(*[lambda a=a: a.send_weights(2) for _, a in trainers])
    for error in got:
        assert isinstance(error, ParameterRebound), got
        assert "'m'" in str(error) and "p.copy_(new)" in str(error), str(error)
    assert model.holds(1) and r0.version == 1  # nothing of version 2 moved
