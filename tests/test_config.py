"""`TransferConfig` is the one source of its defaults, and a group runs on one config (issue 24).

- every worker of a group is checked at connect to hold the leader's config (before anything is
  probed or allocated), refused with a `ConfigMismatch` (a ValueError) naming the worker and
  the differing fields;
- ``depth`` defaults come from the config everywhere a function takes one; ``wait_s`` is the
  one "3 x timeout_s";
- ``python -m controller --local`` plans with the config's round unless told ``--round-kib``.
"""

import inspect

import pytest
from tinygroup import SPEC, Model, in_threads

from weightbridge import (ConfigMismatch, ReceiverAdapter, SenderAdapter, TransferConfig,
                          WeightBridgeError)
from weightbridge.config import DEFAULT_DEPTH, MAX_TIMEOUT_S, WAIT_TIMEOUTS
from weightbridge.driver import LocalControl


def _group(configs_t, configs_r):
    control = LocalControl()
    trainers = [(m := Model(), control.add(SenderAdapter(
        m.params, m.load_weights, SPEC, rank=i, control=control, transport=control.transport,
        config=c))) for i, c in enumerate(configs_t)]
    rollouts = [(m := Model(), control.add(ReceiverAdapter(
        m.params, m.load_weights, SPEC, rank=j, engine=j, engine_rank=0, engine_size=1,
        control=control, transport=control.transport, config=c)))
        for j, c in enumerate(configs_r)]
    return control, trainers, rollouts


def test_a_worker_given_another_config_is_refused_at_connect_before_anything_is_probed():
    leader = TransferConfig(timeout_s=5)
    other = TransferConfig(timeout_s=5, depth=3, round_bytes=1 << 20)
    control, trainers, rollouts = _group([leader, leader], [leader, other])
    for m, _ in trainers + rollouts:
        m.mark()
    got = in_threads(*[a.connect for _, a in trainers])
    error = got[0]
    assert isinstance(error, ConfigMismatch) and isinstance(error, ValueError), got
    assert isinstance(error, WeightBridgeError)
    text = str(error)
    assert text.startswith("R1 was given a different TransferConfig"), text
    assert "round_bytes: 8388608 != 1048576" in text and "depth: 2 != 3" in text
    assert "timeout_s" not in text  # only the fields that differ
    assert isinstance(got[1], Exception)  # the other trainer is told connect failed
    # Refused before the probe (which writes every parameter) and before any buffer.
    assert all(m.unchanged() for m, _ in trainers + rollouts)
    assert all(a.executor is None for _, a in trainers + rollouts)
    assert control.transport.bytes_written == 0


def test_a_trainer_given_another_mode_is_refused_too():
    leader = TransferConfig(timeout_s=5)
    control, trainers, _ = _group([leader, TransferConfig(timeout_s=5, sender_staging=True)],
                                  [leader])
    got = in_threads(*[a.connect for _, a in trainers])
    assert isinstance(got[0], ConfigMismatch), got
    assert str(got[0]).startswith("T1 was given") and "sender_staging: False != True" in str(got[0])


def test_equal_configs_connect():
    control, trainers, rollouts = _group([TransferConfig(timeout_s=5)] * 2,
                                         [TransferConfig(timeout_s=5)] * 2)  # equal, not one
    assert in_threads(*[a.connect for _, a in trainers]) == [None, None]


def test_an_engine_joining_with_another_config_is_refused_before_it_is_probed():
    leader = TransferConfig(timeout_s=5)
    control, trainers, rollouts = _group([leader] * 2, [leader])
    assert in_threads(*[a.connect for _, a in trainers]) == [None, None]
    m = Model()
    joining = control.add(ReceiverAdapter(
        m.params, m.load_weights, SPEC, rank=1, engine=1, engine_rank=0, engine_size=1,
        control=control, transport=control.transport, config=TransferConfig(timeout_s=7)))
    m.mark()
    got = in_threads(*[a.add_engines for _, a in trainers])
    assert isinstance(got[0], ConfigMismatch), got
    assert str(got[0]).startswith("R1 was given") and "timeout_s: 5 != 7" in str(got[0])
    assert isinstance(got[1], Exception) and "timeout_s: 5 != 7" in str(got[1]), got
    assert m.unchanged() and joining.executor is None  # never probed, nothing allocated


def test_differences_names_each_differing_field_with_both_values():
    a, b = TransferConfig(), TransferConfig(depth=3, checksums=False)
    assert a.differences(a) == [] and a.differences(TransferConfig()) == []
    assert a.differences(b) == ["depth: 2 != 3", "checksums: True != False"]


def test_wait_s_is_three_timeouts():
    assert WAIT_TIMEOUTS == 3
    assert TransferConfig(timeout_s=7).wait_s == 21
    assert TransferConfig().wait_s == WAIT_TIMEOUTS * TransferConfig().timeout_s


def test_every_depth_default_is_the_configs():
    from weightbridge.coordination.local import run_plan_locally
    from weightbridge.execution.executor import WorkerExecutor, incoming_ranges, outgoing_ranges
    from weightbridge.simulation.simulate import simulate

    assert TransferConfig().depth == DEFAULT_DEPTH
    for fn in (run_plan_locally, incoming_ranges, outgoing_ranges, WorkerExecutor, simulate):
        assert inspect.signature(fn).parameters["depth"].default == DEFAULT_DEPTH, fn


def test_controller_flags_default_to_the_config():
    from controller.cli import build_parser, transfer_config

    args = build_parser().parse_args([])
    assert transfer_config(args) == TransferConfig()


@pytest.mark.parametrize("flags,round_bytes", [((), TransferConfig().round_bytes),
                                               (("--round-kib", "256"), 256 << 10)])
def test_local_demo_plans_with_the_configs_round(monkeypatch, capsys, flags, round_bytes):
    """``--local`` had a hidden 256 KiB round of its own; now the config's, or --round-kib."""
    import controller.__main__ as cli_main

    seen = []
    real = cli_main.plan_transfer

    def spy(*args, **kwargs):
        seen.append(kwargs["round_bytes"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_main, "plan_transfer", spy)
    cli_main.main(["--local", *flags])
    assert seen == [round_bytes]
    assert "bit-identical" in capsys.readouterr().out


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300, MAX_TIMEOUT_S * 2, True,
                                       float("nan"), 0])
def test_a_timeout_that_is_not_a_finite_bounded_number_is_refused(timeout_s):
    """Issue 44, item 10: ``timeout_s=inf`` or ``1e300`` passed validation and failed later
    inside a wait (OverflowError) or never bounded it; True was read as 1 second."""
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds in"):
        TransferConfig(timeout_s=timeout_s)
    assert TransferConfig(timeout_s=MAX_TIMEOUT_S).timeout_s == MAX_TIMEOUT_S


@pytest.mark.parametrize("writes", ["per-peer", "", None, True])
def test_rdma_writes_other_than_per_range_or_batched_is_refused(writes):
    """Issue 43, item 1: how a step's RDMA writes start is one of two named ways."""
    with pytest.raises(ValueError, match="rdma_writes must be one of"):
        TransferConfig(rdma_writes=writes)
    assert {TransferConfig(rdma_writes=w).rdma_writes for w in ("per-range", "batched")} == {
        "per-range", "batched"}
