"""Worker factories by name, resolved in one place: the CLI, `MeshTransfer` and every actor.

A run names its workers as a demo model size (``"tiny"``, ``"medium"``, ``"small"``: the
factories of `meshes.workers`) or as ``module:name``, a `weightbridge.WorkerParts` factory.
`resolve_workers` turns either into the factory's import path, checking before anything
spawns that it imports and that a demo model's specs fit it; each actor then loads that path
in its own process (`load_factory`). No Monarch import here: the CLI resolves before Monarch
starts (it reads its TLS files once).

Typical usage::

    path = resolve_workers("tiny", trainer_spec, rollout_spec)   # "meshes.workers:tiny"
    factory = load_factory(path)                                  # in the actor's process
"""

from __future__ import annotations

import importlib

from weightbridge.specs import RolloutSpec, TrainerSpec


def load_factory(path: str):
    """The worker factory at ``path`` ("package.module:name").

    Raises:
        ValueError: a path without ``:``, a module that does not import (or raises while it
            does), a missing or non-callable name.
    """
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"worker factory {path!r}: give it as module:name, e.g. "
                         f"meshes.workers:tiny")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error (a SyntaxError, ...)
        raise ValueError(f"worker factory {path!r}: module {module_name!r} does not import "
                         f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"worker factory {path!r}: {module_name} has no callable {name!r}")
    return factory


def resolve_workers(workers: str, trainer: TrainerSpec, rollout: RolloutSpec) -> str:
    """The factory path of ``workers`` (a demo model name or ``module:name``), with a demo
    model's specs validated; raises ValueError before anything spawns."""
    from meshes.workers import FACTORIES

    if ":" not in workers:
        if workers not in FACTORIES:
            raise ValueError(f"unknown model {workers!r}: give a demo model "
                             f"({sorted(FACTORIES)}) or a worker factory as module:name")
        from meshes.qwen3_moe import SIZES

        trainer.validate(SIZES[workers])
        rollout.validate(SIZES[workers])
        workers = FACTORIES[workers]
    load_factory(workers)  # fails here, before any proc spawns
    return workers
