"""Every exception the library raises on purpose, under one base: `WeightBridgeError`.

    WeightBridgeError
        LayoutError (also a ValueError)      layouts cannot be discovered or do not fit
        ConfigMismatch (also a ValueError)   workers of one group were given different configs
        TransferFailed (a RuntimeError)      an update did not reach the rollouts
            WorkersLost                      ... workers were lost and left out (controller)
            GroupClosed                      ... the group or MeshTransfer was closed
        ChecksumMismatch (a RuntimeError)    bytes changed on their way into a round buffer
        ReplicaMismatch (a RuntimeError)     data-parallel replicas hold different bytes
        StepFailed (a RuntimeError)          a step of the round sequencer failed on a worker
        CatchUpRefused (a RuntimeError)      a join cannot send the version the engines hold
        ParameterRebound (a RuntimeError)    a trainer's parameter no longer uses its storage

Bad input is also refused with a plain ``ValueError`` and a slow peer with ``TimeoutError``,
each before any byte moves where it can be. What connect can go on without (a cache
directory it cannot write) is warned about once per cause and place (`warn_once`).

Errors cross processes as exceptions: on a mesh an endpoint's exception reaches the caller
wrapped in Monarch's ``ActorError`` (whose ``exception`` attribute holds the original);
`library_error` takes it out, so the caller sees the library's message first.
`failure_kind` / `from_kind` turn an error into a short wire form and back for the control
messages that tell peers of a failure.

Typical usage::

    try:
        mesh.train_and_send.call(v).get()
    except Exception as e:
        raise library_error(e) from e     # TransferFailed("worker T1 ...") rather than ActorError
    with surfaced():                      # the same, as a block
        mesh.train_and_send.call(v).get()
"""

from __future__ import annotations

import contextlib
import warnings


class WeightBridgeError(Exception):
    """Base of every exception the library raises on purpose: catch it to catch them all."""


class LayoutError(WeightBridgeError, ValueError):
    """A worker's layout cannot be discovered, or trainer and rollout layouts do not fit.

    Raised before any weight byte moves: a loader that changes values, a dtype mismatch between
    a checkpoint tensor and the parameter it lands in, a rollout element no trainer holds.
    """


class ConfigMismatch(WeightBridgeError, ValueError):
    """Workers of one transfer group were given different `TransferConfig`s; raised at connect,
    before any buffer is allocated, naming the worker and the fields that differ."""


class TransferFailed(WeightBridgeError, RuntimeError):
    """An update did not reach the rollouts: a worker was lost during a transfer (its process
    died or stopped answering), a step failed on some worker, or the group was broken.

    The message names the worker, its engine and the version, says which engines were excluded
    and what the surviving engines hold, and how to go on (with the adapters: restart a lost
    engine and add it as a new engine, `SenderAdapter.add_engines`). The controller
    (`controller.MeshTransfer`) raises it too.
    """


class WorkersLost(TransferFailed):
    """Workers were lost during an update and left out: trainers whose regions their replicas
    also hold, rollout engines. Raised within ``timeout_s`` of the loss; without sender
    staging the version is then re-sent over a new plan to the surviving engines (the
    `MeshTransfer`'s ``wait()`` returns that re-send's report), and the `MeshTransfer` goes
    on with them.

    Attributes:
        lost_engines: Every rollout engine excluded so far.
        lost_trainers: Every trainer excluded so far.
    """

    def __init__(self, message: str, lost_engines: frozenset[int] = frozenset(),
                 lost_trainers: frozenset[int] = frozenset()):
        super().__init__(message)
        self.lost_engines, self.lost_trainers = lost_engines, lost_trainers

    def __reduce__(self):
        return type(self), (str(self), self.lost_engines, self.lost_trainers)


class GroupClosed(TransferFailed):
    """A call on a transfer group (`TransferGroup`) or a `controller.MeshTransfer` after it
    was closed: nothing more moves through it; build a new one to go on."""


class ChecksumMismatch(WeightBridgeError, RuntimeError):
    """Bytes that arrived in a round buffer differ from what their writer sent."""


class ReplicaMismatch(WeightBridgeError, RuntimeError):
    """Data-parallel trainer replicas (the same layout of the checkpoint) hold different bytes
    for a parameter; raised before any byte of the update moves."""


class StepFailed(WeightBridgeError, RuntimeError):
    """A step of the round sequencer failed on some worker; the message names the round and
    the step, then the worker's own error (`library_error` of what the step raised)."""


class CatchUpRefused(WeightBridgeError, RuntimeError):
    """An engine's join was refused before anything spawned or moved: its catch-up would
    send other bytes than the version the engines hold (without sender staging it re-sends
    the trainers' parameters, and a train step ran since that version was sent)."""


class ParameterRebound(WeightBridgeError, RuntimeError):
    """A trainer's parameter no longer uses the storage it was registered with (``p.data =
    new``, ``load_state_dict(assign=True)``): the copy tables read the old storage, so its
    new values would never be sent. Raised before any byte of the update moves."""


# -- across processes ---------------------------------------------------------------------------

SURFACED = (WeightBridgeError, ValueError, TimeoutError)
"""What `library_error` takes out of a Monarch wrapper: the library's own exceptions and the
two builtin kinds it raises on purpose (bad input, a bounded wait that ran out). Anything else
(a bug: KeyError, AssertionError) stays wrapped, with the remote traceback that explains it."""


def _wrapped(exc: BaseException) -> BaseException | None:
    """The exception a Monarch ``ActorError`` carries (its ``exception`` attribute, unpickled
    on the caller's side), or None for any other exception. Checked by class name and module,
    so this module imports no Monarch."""
    for cls in type(exc).__mro__:
        if cls.__name__ == "ActorError" and cls.__module__.startswith("monarch"):
            inner = getattr(exc, "exception", None)
            return inner if isinstance(inner, BaseException) else None
    return None


def library_error(exc: BaseException) -> BaseException:
    """The library's own exception inside ``exc``, or ``exc`` itself.

    Unwraps Monarch ``ActorError``s (nested ones too: a controller calls an actor whose
    library call failed on a peer) down to the first exception of a `SURFACED` kind, and notes
    where it was raised (``add_note``: shown after its message). Anything else, including
    Monarch's ``SupervisionError`` (a process died: there is no remote exception to show), is
    returned unchanged. Use as ``raise library_error(e) from e``.
    """
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        if isinstance(current, SURFACED):
            if current is not exc:
                where = str(getattr(seen[-1], "message", "") or type(seen[-1]).__name__)
                note = f"(raised remotely; Monarch reported: {where})"
                if note not in getattr(current, "__notes__", ()):
                    current.add_note(note)
            return current
        seen.append(current)
        current = _wrapped(current)
    return exc


@contextlib.contextmanager
def surfaced():
    """Re-raise what the block raises as its `library_error` (chained to the original), so
    ``except TransferFailed`` (say) catches an update that failed on a remote worker."""
    try:
        yield
    except Exception as e:
        inner = library_error(e)
        if inner is e:
            raise
        raise inner from e


def describe(exc: BaseException) -> str:
    """``Kind: message`` of what a worker raised: one line to put in a wrapping error. Unlike
    `library_error`, any kind is taken out of Monarch's wrappers (an ``OSError`` of a loader
    too): only its text is used, so nothing is lost by leaving the traceback behind."""
    inner, seen = exc, [exc]
    while (nested := _wrapped(inner)) is not None and all(nested is not s for s in seen):
        inner = nested
        seen.append(inner)
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


KINDS: dict[str, type[Exception]] = {
    "input": ValueError, "timeout": TimeoutError, "transfer": TransferFailed, "lost": WorkersLost,
    "replica": ReplicaMismatch, "layout": LayoutError, "config": ConfigMismatch,
}
"""The wire names of the errors one worker tells others of (``PeerCall.FAILED``): the class
to raise on the receiving side. Unknown names raise `TransferFailed`. Each class is one the
receiving call documents (``send_weights`` raises `TransferFailed` for a failed update, so a
`ChecksumMismatch` travels as "transfer", its message naming it)."""


def failure_kind(exc: BaseException) -> str:
    """The `KINDS` name of ``exc`` (after `library_error`): the most specific class it is an
    instance of; "transfer" for anything else."""
    inner = library_error(exc)
    for name in ("replica", "layout", "config", "lost", "transfer", "timeout", "input"):
        if isinstance(inner, KINDS[name]):
            return name
    return "transfer"


def told(exc: BaseException) -> tuple[str, str, tuple | None]:
    """``exc`` as one worker tells others of it: (kind, message, lost), what `from_kind`
    turns back into an exception of the same class (``lost``: the (engines, trainers) out,
    for a `WorkersLost`)."""
    inner = library_error(exc)
    lost = ((tuple(sorted(inner.lost_engines)), tuple(sorted(inner.lost_trainers)))
            if isinstance(inner, WorkersLost) else None)
    return failure_kind(inner), str(inner), lost


def from_kind(kind: str, message: str, lost: tuple | None = None) -> Exception:
    """The exception to raise for a failure told as (``kind``, ``message``); ``lost``: the
    (engines, trainers) out, for "lost"."""
    if kind == "lost":
        engines, trainers = lost or ((), ())
        return WorkersLost(message, frozenset(engines), frozenset(trainers))
    return KINDS.get(kind, TransferFailed)(message)


_warned: set[tuple] = set()
"""The causes `warn_once` has warned about in this process."""


def warn_once(cause: tuple, message: str, category: type[Warning], stacklevel: int) -> None:
    """``warnings.warn`` the first time ``cause`` (e.g. the warning's class, a directory and
    what went wrong there) comes up in this process, not at every connect after it.
    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does."""
    if cause in _warned:
        return
    _warned.add(cause)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
