"""The private Monarch calls WeightBridge makes, in one place, checked once against the install.

`TransferAgent` answers its calls from its own threads (a sync actor that serves many calls at
once), which takes Monarch's private ``Port._resolve_and_send_blocking``: what Monarch itself
does with a sync endpoint's result; and a mailbox message names its reply port by the port's
private reference and rank, rebuilt where it is served (`reply_address`, `reply_port`).
Private names can vanish in any release, so `check` looks for each of them once and fails with
the installed version, the supported one and what to do, instead of an ``AttributeError`` deep
inside a peer call.

Typical usage::

    check()                       # TransferGroup.spawn and each agent, before any call
    answer(port, result)          # an agent thread, for a call served off the actor's thread
    mesh_name(actor_mesh)         # the name a supervision fault of that mesh carries
    address = reply_address(port) # a reply port as a message carries it (~250 bytes) ...
    port = reply_port(address)    # ... and the port again, in the receiving actor
"""

from __future__ import annotations

import functools
from importlib import metadata

SUPPORTED = "0.7"
"""The torchmonarch release (major.minor) whose private API this module was written against."""

_PRIVATE = (("monarch._src.actor.actor_mesh", "Port", "_resolve_and_send_blocking"),
            ("monarch._src.actor.actor_mesh", "Port", "_port_ref"),
            ("monarch._src.actor.actor_mesh", "Port", "_rank"),
            ("monarch._src.actor.actor_mesh", "Instance", "_as_rust"),
            ("monarch._src.actor.actor_mesh", "ActorMesh", "_name"))
"""(module, class, attribute) of every private Monarch name the library uses."""


def installed_version() -> str:
    try:
        return metadata.version("torchmonarch")
    except metadata.PackageNotFoundError:
        return "unknown (no torchmonarch distribution found)"


@functools.cache
def check() -> None:
    """Raise ImportError, once per process, when a private Monarch name the library uses is
    missing from the installed torchmonarch."""
    import importlib

    missing = []
    for module, cls, attr in _PRIVATE:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{cls}")
            continue
        if not hasattr(owner, attr):
            missing.append(f"{module}.{cls}.{attr}")
    if missing:
        raise ImportError(
            f"weightbridge's Monarch transfer groups need torchmonarch {SUPPORTED}.x, but the "
            f"installed torchmonarch {installed_version()} lacks {', '.join(missing)} (private "
            f"Monarch APIs the agents answer calls with): install torchmonarch=={SUPPORTED}.* "
            f"(pip install 'torchmonarch=={SUPPORTED}.*'), or update weightbridge/mesh/"
            f"monarch_api.py for this release")


def answer(port, result) -> None:
    """Send ``result`` to the caller of an explicit-response-port endpoint from any thread,
    as Monarch answers a sync endpoint (mesh references in ``result`` resolved first)."""
    port._resolve_and_send_blocking(result)


def mesh_name(mesh) -> str:
    """The name Monarch gives an actor mesh, as its supervision faults carry it
    (``MeshFailure.mesh_name``)."""
    return mesh._name.get()


def reply_address(port) -> tuple:
    """``port`` (a `monarch.actor.Port`) as a message carries it: its port reference and
    rank, about 250 bytes pickled. A Port pickles the function that rebuilds it by value
    (``Port.__reduce__``'s local ``_reconstruct_port``), about 1.6 KB in every message that
    names a reply port: on the emulated cluster's 50 Mbit/s links 1% of a rollout's link
    carried those functions."""
    return port._port_ref, port._rank


def reply_port(address: tuple):
    """The `monarch.actor.Port` of `reply_address`, rebuilt as ``Port.__reduce__`` rebuilds it
    on the client side: sending through it as the current actor (call it in the receiving
    actor's context, as the mailbox's serving thread runs)."""
    from monarch._src.actor.actor_mesh import Port, context

    port_ref, rank = address
    return Port(port_ref, context().actor_instance._as_rust(), rank)

