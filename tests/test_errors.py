"""One exception hierarchy, errors across processes, and the old names (issue 24).

Every exception the library raises on purpose is a `WeightBridgeError`; the names users catch
import from where they did (the old ones with a DeprecationWarning naming the new place);
`library_error` takes the library's exception out of Monarch's ``ActorError`` so the caller
reads its message first.
"""

import importlib
import pickle
import warnings

import pytest

import weightbridge
from weightbridge import errors
from weightbridge.errors import (CatchUpRefused, ChecksumMismatch, ConfigMismatch, GroupClosed,
                                 LayoutError, ParameterRebound, ReplicaMismatch, StepFailed,
                                 TransferFailed, WeightBridgeError, WorkersLost, describe,
                                 failure_kind, from_kind, library_error)

LIBRARY_ERRORS = (LayoutError, ConfigMismatch, TransferFailed, WorkersLost, ChecksumMismatch,
                  ReplicaMismatch, StepFailed, CatchUpRefused, ParameterRebound, GroupClosed)


def test_every_library_exception_is_a_weightbridge_error_and_keeps_its_builtin_base():
    for cls in LIBRARY_ERRORS:
        assert issubclass(cls, WeightBridgeError), cls
    # What users caught before still catches them.
    assert issubclass(LayoutError, ValueError) and issubclass(ConfigMismatch, ValueError)
    for cls in (TransferFailed, ChecksumMismatch, ReplicaMismatch, StepFailed, CatchUpRefused,
                ParameterRebound):
        assert issubclass(cls, RuntimeError), cls
    assert issubclass(WorkersLost, TransferFailed) and issubclass(GroupClosed, TransferFailed)
    # Every exception class the library defines is in the hierarchy (nothing scattered).
    defined = [v for v in vars(errors).values()
               if isinstance(v, type) and issubclass(v, BaseException)]
    assert set(defined) == set(LIBRARY_ERRORS) | {WeightBridgeError}


OLD_PATHS = [  # (module, name, the class it must be)
    ("weightbridge", "TransferFailed", TransferFailed),
    ("weightbridge", "ChecksumMismatch", ChecksumMismatch),
    ("weightbridge", "ReplicaMismatch", ReplicaMismatch),
    ("weightbridge", "LayoutError", LayoutError),
    ("weightbridge.adapters", "TransferFailed", TransferFailed),
    ("weightbridge.coordination.worker", "ChecksumMismatch", ChecksumMismatch),
    ("weightbridge.coordination.worker", "ReplicaMismatch", ReplicaMismatch),
    ("weightbridge.coordination.sequencer", "StepFailed", StepFailed),
    ("controller.report", "WorkersLost", WorkersLost),
]


@pytest.mark.parametrize("module,name,cls", OLD_PATHS, ids=[f"{m}.{n}" for m, n, _ in OLD_PATHS])
def test_old_import_paths_give_the_one_class(module, name, cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these paths are not deprecated
        assert getattr(importlib.import_module(module), name) is cls


def test_workers_lost_is_a_transfer_failed():
    # One event, one class: catching TransferFailed catches what both paths raise.
    with pytest.raises(TransferFailed):
        raise WorkersLost("engine 1 lost", frozenset({1}), frozenset())


def test_workers_lost_keeps_its_attributes_across_a_pickle():
    e = pickle.loads(pickle.dumps(WorkersLost("engine 1 lost", frozenset({1}), frozenset({2}))))
    assert (str(e), e.lost_engines, e.lost_trainers) == (
        "engine 1 lost", frozenset({1}), frozenset({2}))


# -- the public faces ---------------------------------------------------------------------------

MOVED = sorted(weightbridge._MOVED)


@pytest.mark.parametrize("name", MOVED)
def test_names_moved_off_the_user_face_still_import_and_warn_with_their_new_path(name):
    new = weightbridge._MOVED[name]
    with pytest.warns(DeprecationWarning, match=f"from {new} import {name}"):
        old = getattr(weightbridge, name)
    if name == "TransferAgent":  # a Monarch actor: compare by name (no second import)
        assert old.__name__ == "TransferAgent"
        return
    assert old is getattr(importlib.import_module(new), name)


def test_the_user_face_imports_without_warnings_and_hides_internals():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in weightbridge.__all__:
            if name != "TransferGroup":  # needs Monarch: checked in the mesh tests
                assert getattr(weightbridge, name) is not None, name
    for internal in ("Chunk", "WorkerRound", "TransferAgent", "TransferWorker"):
        assert internal not in weightbridge.__all__
    assert len(weightbridge.__all__) < 44


def test_the_driver_face_names_resolve():
    driver = importlib.import_module("weightbridge.driver")
    monarch_names = set(driver._MESH)
    for name in driver.__all__:
        if name not in monarch_names:
            assert getattr(driver, name) is not None, name
    assert {"ControlPlane", "connect_group", "run_update", "GroupLeader", "MeshControl",
            "library_error", "TrainerSpec", "RolloutSpec"} <= set(driver.__all__)


def test_mesh_specs_are_public_in_the_library():
    from weightbridge import driver, specs

    assert driver.TrainerSpec is specs.TrainerSpec and driver.RolloutSpec is specs.RolloutSpec


# -- across processes ---------------------------------------------------------------------------

def _actor_error(inner: BaseException, call: str = "TrainerActor.send"):
    from monarch._src.actor.actor_mesh import ActorError

    # As the caller receives it: pickled by the actor, unpickled here.
    return pickle.loads(pickle.dumps(ActorError(inner, f"Actor call {call} failed.")))


def test_library_error_takes_ours_out_of_an_actor_error_message_first():
    wrapped = _actor_error(TransferFailed("worker R1 (engine 1) was lost during version 3"))
    assert str(wrapped).startswith("Actor call")  # what the caller read before
    got = library_error(wrapped)
    assert type(got) is TransferFailed
    assert str(got) == "worker R1 (engine 1) was lost during version 3"
    assert any("TrainerActor.send" in n for n in got.__notes__)
    assert describe(wrapped) == "TransferFailed: worker R1 (engine 1) was lost during version 3"


def test_library_error_unwraps_nested_actor_errors_and_our_builtin_kinds():
    inner = ReplicaMismatch("trainers 0 and 1 hold different bytes for 'w'")
    twice = _actor_error(_actor_error(inner, "TransferAgent.serve(digest)"))
    got = library_error(twice)
    assert type(got) is ReplicaMismatch and str(got).startswith("trainers 0 and 1")
    bad_input = library_error(_actor_error(ValueError("rank 3 says engine 0")))
    assert type(bad_input) is ValueError and str(bad_input) == "rank 3 says engine 0"
    assert type(library_error(_actor_error(TimeoutError("no answer")))) is TimeoutError


def test_library_error_leaves_bugs_and_other_errors_wrapped():
    bug = _actor_error(KeyError("w"))
    assert library_error(bug) is bug  # the remote traceback explains a bug: keep it
    plain = RuntimeError("supervision: proc died")
    assert library_error(plain) is plain
    ours = TransferFailed("x")
    assert library_error(ours) is ours and not getattr(ours, "__notes__", None)


def test_library_error_notes_the_wrapper_once():
    inner = ChecksumMismatch("R1: 32 bytes at offset 48 differ")
    wrapped = _actor_error(inner)
    first = library_error(wrapped)
    assert library_error(wrapped) is first and len(first.__notes__) == 1


def test_a_step_failure_names_the_workers_own_error_not_monarchs_wrapper():
    import asyncio

    from weightbridge.coordination.sequencer import run_rounds
    from weightbridge.types import Stage

    class Steps:
        async def send(self, r):
            # Nested: the controller's call on an actor whose library call failed on a peer.
            raise _actor_error(_actor_error(ChecksumMismatch("R1: 32 bytes at offset 48 differ")))

        async def forward(self, r, stage):
            pass

        async def land(self, r):
            pass

    with pytest.raises(StepFailed) as info:
        asyncio.run(run_rounds(Steps(), frozenset({(0, Stage.RECEIVE)}), 1, 2))
    assert str(info.value) == ("round 0, trainers' send: ChecksumMismatch: R1: 32 bytes at "
                               "offset 48 differ")


@pytest.mark.parametrize("error,kind", [
    (ValueError("x"), "input"), (TimeoutError("x"), "timeout"), (TransferFailed("x"), "transfer"),
    (ReplicaMismatch("x"), "replica"), (ChecksumMismatch("x"), "transfer"),
    (LayoutError("x"), "layout"), (ConfigMismatch("x"), "config"), (KeyError("x"), "transfer"),
    (WorkersLost("x"), "lost")])
def test_failures_told_to_peers_come_back_as_the_same_class(error, kind):
    assert failure_kind(error) == kind
    back = from_kind(kind, "trainer 0: it failed")
    assert str(back) == "trainer 0: it failed"
    assert type(back) is (type(error) if kind != "transfer" else TransferFailed)
    assert failure_kind(_actor_error(error)) == kind
    assert type(from_kind("unknown", "m")) is TransferFailed


def test_workers_lost_told_to_peers_keeps_who_is_out():
    """Trainer 0 tells the other trainers of a loss: each raises WorkersLost, as trainer 0
    and the controller do, naming the same engines and trainers (they raised TransferFailed)."""
    back = from_kind("lost", "worker R1 (engine 1) failed", ((1,), (3,)))
    assert type(back) is WorkersLost and isinstance(back, TransferFailed)
    assert back.lost_engines == {1} and back.lost_trainers == {3}


def test_a_peer_calls_error_is_raised_as_the_library_error_chained_to_the_wrapper():
    """`gathered` (every control plane's `call`): the mesh path's ActorError comes out as ours."""
    from weightbridge.coordination.control import PeerFailed, gathered

    wrapped = _actor_error(TransferFailed("R0: engine 0 was removed from the group"))
    with pytest.raises(TransferFailed, match="^R0: engine 0 was removed") as info:
        gathered([1, PeerFailed(wrapped)], return_errors=False)
    assert info.value.__cause__ is wrapped
    got = gathered([1, PeerFailed(wrapped), PeerFailed(KeyError("w"))], return_errors=True)
    assert got[0] == 1 and type(got[1]) is TransferFailed and type(got[2]) is KeyError


def test_surfaced_reraises_ours_and_leaves_the_rest():
    from weightbridge.errors import surfaced

    with pytest.raises(LayoutError, match="^experts.0 is held by no trainer"):
        with surfaced():
            raise _actor_error(LayoutError("experts.0 is held by no trainer"))
    bug = _actor_error(KeyError("w"))
    with pytest.raises(type(bug)) as info:
        with surfaced():
            raise bug
    assert info.value is bug


def test_describe_names_any_workers_own_error_out_of_monarchs_wrappers():
    """(A step's message: a loader's OSError is named, though it stays wrapped when raised.)"""
    wrapped = _actor_error(_actor_error(OSError("rollout 1: assemble kernel failed")))
    assert describe(wrapped) == "OSError: rollout 1: assemble kernel failed"
    assert library_error(wrapped) is wrapped
