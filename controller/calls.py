"""The discipline of `controller.driver.MeshTransfer`'s public calls: one at a time, none after
`close`, and every error raised as the library's own (`serialized`)."""

from __future__ import annotations

import functools

# The package first: `from weightbridge import` waits for its __init__ when another thread of
# an actor process is running it (see controller/membership.py).
from weightbridge import GroupClosed, TransferFailed, WeightBridgeError
from weightbridge.driver import describe, library_error


def serialized(method):
    """One public call of a `MeshTransfer` at a time (its ``calls`` lock, reentrant): a
    membership change or a poll from another thread waits for the update running, as the
    adapters' session lock makes it, instead of re-planning under its rounds. After `close`
    every call raises `GroupClosed`; a call that `close` (from another thread) ended raises
    it too. Whatever else escapes is raised as the library's own error (`documented`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        name = method.__name__
        with self.calls:
            if self.closed:
                raise GroupClosed(f"{name}() on a MeshTransfer that was closed: this "
                                  f"MeshTransfer was closed (close(), or the end of its with "
                                  f"block) and its actors are stopped; build a new MeshTransfer "
                                  f"to go on")
            try:
                return method(self, *args, **kwargs)
            except BaseException as e:  # noqa: BLE001  (raised again, as the library's)
                error = documented(e, name, self.closed)
                if error is e:
                    raise
                raise error from e
    return run


def documented(error: BaseException, call: str, closed: bool) -> BaseException:
    """What a public call of a `MeshTransfer` raises for ``error``: `GroupClosed` when the
    object was ``closed`` while the call ran (Monarch's ``CancelledError``, a stopped actor),
    the library's error inside a Monarch wrapper (`library_error`), a ``ValueError`` or a
    `WeightBridgeError` as it is; anything else (a plain ``TimeoutError``, a dead process's
    ``SupervisionError``, an ``AssertionError``) as a `TransferFailed` naming it. A
    ``KeyboardInterrupt`` or ``SystemExit`` stays what it is, and so does the plain
    ``RuntimeError`` of a call made before `connect`."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return error
    if closed and not isinstance(error, GroupClosed):
        return GroupClosed(f"{call}() was ended by close() (from another thread): this "
                           f"MeshTransfer was closed while it ran ({describe(error)}) and its "
                           f"actors are stopped; build a new MeshTransfer to go on")
    inner = library_error(error)
    if isinstance(inner, (WeightBridgeError, ValueError)) or type(inner) is RuntimeError:
        return inner
    return TransferFailed(f"{call}() failed: {describe(inner)}; what the rollouts hold is not "
                          f"known: close this MeshTransfer and start again (if a process died, "
                          f"see why first)")
