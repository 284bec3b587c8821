"""The controller's command line: its flags, and `validate`, which checks all of them first.

Bad input (a flag out of range, a spec that does not fit, a flag the chosen run would ignore)
is refused by `validate` before anything spawns: one ``error: ...`` line on stderr, exit 2
(`refuse`). Exit 1 means the weights did not match. `validate` imports no Monarch: Monarch reads
its transport once, at import, and a cluster run sets it only once its hosts are up.

Typical usage (``python -m controller``, controller/__main__.py)::

    args = build_parser().parse_args(argv)
    run = validate(args)          # ValueError saying what to fix
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NamedTuple

from controller.security import Credentials, Security, add_flags, check_files, resolve
from meshes.factories import resolve_workers
from meshes.qwen3_moe import SIZES
from weightbridge.driver import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig
from weightbridge.driver import Mode

DEFAULT_TRAINER = "nodes=1,gpus=4,tp=2,ep=2"
DEFAULT_ROLLOUT = "engines=2,nodes=1,gpus=2,tp=2"
"""The default specs are also the fixed layouts of ``--local``."""
BAD_INPUT = 2
"""Exit status of refused input (argparse's too); 1 is reserved for weights that do not match."""
WORKERS_LOST = 3
"""Exit status of a mesh run that lost workers and finished its updates on the others."""


class Run(NamedTuple):
    """What `validate` hands the run: parsed specs, the config, the factory, attach addresses."""

    trainer: TrainerSpec
    rollout: RolloutSpec
    config: TransferConfig
    workers: str
    """A demo model name or ``module:factory``."""
    addresses: tuple[list[str], list[str]] | None
    """(trainer, rollout) worker addresses to attach to; None: spawn on this host."""
    security: Security | None = None
    """Multi-host runs (attach, cluster): mutual TLS files, or insecure; None: one host."""


class _Parser(argparse.ArgumentParser):
    """argparse, but its own errors (a non-integer, an unknown flag) are one line too."""

    def error(self, message: str):
        refuse(f"{message} (see --help)")


def refuse(message: str):
    """Print the one ``error:`` line of refused input and exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags (see the module doc)."""
    parser = _Parser(prog="python -m controller", description="WeightBridge controller")
    parser.add_argument("--trainer", default=DEFAULT_TRAINER, help="trainer mesh spec")
    parser.add_argument("--rollout", default=DEFAULT_ROLLOUT, help="rollout mesh spec")
    parser.add_argument("--updates", type=int, default=3, help="model versions to transfer")
    parser.add_argument("--model", choices=sorted(SIZES), default="tiny",
                        help="the demo model's size (meshes.workers)")
    parser.add_argument("--workers", metavar="MODULE:FACTORY",
                        help="a worker factory to run instead of the demo model: "
                             "factory(side, spec, rank) -> weightbridge.WorkerParts")
    parser.add_argument("--round-kib", type=int,
                        help=f"KiB per round buffer (default "
                             f"{TransferConfig().round_bytes >> 10}, TransferConfig's; --local "
                             f"too: give --round-kib 256 to see the tiny model in several rounds)")
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SYNC.value,
                        help="sync mode: sync, ss (sender staging: the trainers go on once "
                             "their copy is staged), rs (receiver staging: the rollouts install "
                             "at their next step), async (both); docs/controller.md")
    parser.add_argument("--depth", type=int, default=TransferConfig().depth,
                        help=f"round arenas per worker (default {TransferConfig().depth}; 3 "
                             f"hides slow control messages)")
    parser.add_argument("--timeout", type=float, default=TransferConfig().timeout_s,
                        help="seconds within which a lost or stalled worker fails an update")
    parser.add_argument("--trace", metavar="PATH",
                        help="write the last update's per-rank, per-stage timeline here "
                             "(Chrome trace JSON; open in Perfetto)")
    parser.add_argument("--local", action="store_true",
                        help="in-process demo (fixed layouts, no meshes)")
    parser.add_argument("--attach-trainers", metavar="ADDRS",
                        help="comma-separated Monarch worker addresses (tcp://HOST:PORT), one "
                             "per trainer node, to attach to instead of spawning on this host")
    parser.add_argument("--attach-rollouts", metavar="ADDRS",
                        help="likewise, one per rollout node, engine by engine")
    parser.add_argument("--cluster", type=int, metavar="N", nargs="?", const=0,
                        help="bring up an emulated cluster of N hosts here (network namespaces, "
                             "links shaped by tc; N defaults to trainer nodes + rollout nodes), "
                             "run on it, tear it down (controller/cluster.py; needs root)")
    parser.add_argument("--link-mbit", type=float,
                        help="host link rate, Mbit/s each direction: shapes --cluster links "
                             "(default 400) and replaces the link probe in Eq. (1)")
    add_flags(parser)  # --tls-dir, --tls-ca, --tls-cert, --tls-key, --insecure
    return parser


# -- validation: everything, before anything spawns ---------------------------------------------

def validate(args) -> Run:
    """Check every flag and both specs against the run they select. Spawns nothing and imports
    no Monarch itself (Monarch reads its transport once, at import, and a cluster run sets it
    only once its hosts are up). Raises ValueError saying what to fix."""
    config = transfer_config(args)
    check_flags(args)
    trainer, rollout = parse_specs(args)
    if args.local:
        check_ignored(args, "--local", "runs the fixed in-process demo (the default --trainer "
                      "and --rollout layouts, one transfer) and honours only --model and "
                      "--round-kib", keep={"local", "model", "round_kib"})
        if (trainer, rollout) != (TrainerSpec.parse(DEFAULT_TRAINER),
                                  RolloutSpec.parse(DEFAULT_ROLLOUT)):
            raise ValueError(f"--local runs the fixed layouts --trainer {DEFAULT_TRAINER!r} "
                             f"--rollout {DEFAULT_ROLLOUT!r}; drop --trainer/--rollout or run "
                             f"without --local")
    workers = check_workers(args, trainer, rollout)
    if args.cluster is not None:
        check_ignored(args, "--cluster", "attaches to the emulated hosts it brings up",
                      only={"attach_trainers", "attach_rollouts", "local"})
        check_cluster(args, trainer, rollout)
    addresses = attach_addresses(args, trainer, rollout)
    return Run(trainer, rollout, config, workers, addresses,
               check_security(args, addresses, trainer.nodes + rollout.engines * rollout.nodes))


def transfer_config(args) -> TransferConfig:
    """The CLI's flags as a `TransferConfig`: --round-kib and --depth checked in the flags' own
    terms, then TransferConfig's own checks (the timeout, ...), each naming its flag."""
    if args.round_kib is not None and args.round_kib < 1:
        raise ValueError(f"--round-kib must be a positive number of KiB, got {args.round_kib}")
    if args.depth < 2:
        raise ValueError(f"--depth must be >= 2 round arenas per worker (one fills while "
                         f"another drains), got {args.depth}")
    mode = Mode(args.mode)
    fields = {"depth": ("--depth", args.depth), "timeout_s": ("--timeout", args.timeout),
              "sender_staging": ("--mode", mode.sender_staging),
              "receiver_staging": ("--mode", mode.receiver_staging)}
    if args.round_kib is not None:
        fields["round_bytes"] = ("--round-kib", args.round_kib << 10)
    for field, (flag, value) in fields.items():
        try:
            TransferConfig(**{field: value})
        except ValueError as e:
            shown = args.mode if flag == "--mode" else f"{value:g}"  # the flag as typed
            raise ValueError(f"{flag} {shown}: {e}") from None
    return TransferConfig(**{field: value for field, (_, value) in fields.items()})


def check_flags(args) -> None:
    """The flags TransferConfig does not hold: --updates, --link-mbit, --cluster N, --trace."""
    if args.updates < 1:
        raise ValueError(f"--updates must be at least 1, got {args.updates}")
    if args.link_mbit is not None and not (args.link_mbit > 0 and math.isfinite(args.link_mbit)):
        raise ValueError(f"--link-mbit must be a positive, finite rate in Mbit/s, got "
                         f"{args.link_mbit:g}")
    if args.cluster is not None and args.cluster < 0:
        raise ValueError(f"--cluster {args.cluster}: give a positive number of hosts, or "
                         f"--cluster alone for one host per node of the specs")
    if args.trace:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if os.path.isdir(args.trace) or not os.path.isdir(folder):
            raise ValueError(f"--trace {args.trace}: give a file path in an existing folder "
                             f"(the trace is written after the last update)")


def parse_specs(args) -> tuple[TrainerSpec, RolloutSpec]:
    """Both specs, their layouts checked (for any worker factory)."""
    trainer, rollout = TrainerSpec.parse(args.trainer), RolloutSpec.parse(args.rollout)
    trainer.validate()
    rollout.validate()
    return trainer, rollout


def check_ignored(args, flag: str, why: str, *, keep=(), only=None) -> None:
    """Refuse flags set away from their defaults that the run of ``flag`` would ignore: those
    not in ``keep`` (specs aside: compared by layout), or only those in ``only``."""
    defaults = vars(build_parser().parse_args([]))
    ignored = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
               if value != defaults[name] and name not in keep
               and name not in ("trainer", "rollout") and (only is None or name in only)]
    if ignored:
        raise ValueError(f"{flag} {why}; it would ignore {', '.join(ignored)}: drop "
                         f"{'it' if len(ignored) == 1 else 'them'} or run without {flag}")


def check_workers(args, trainer: TrainerSpec, rollout: RolloutSpec) -> str:
    """The worker factory the run uses: a demo model (the specs checked against it) or
    ``module:factory``, imported here so a typo fails before anything spawns."""
    if args.workers and args.model != build_parser().get_default("model"):
        raise ValueError(f"--model {args.model} sizes the demo model, but --workers "
                         f"{args.workers} replaces it: drop one of them")
    workers = args.workers or args.model
    resolve_workers(workers, trainer, rollout)  # (imports it: a typo fails here)
    return workers


def check_cluster(args, trainer: TrainerSpec, rollout: RolloutSpec) -> None:
    """--cluster N: one emulated host per node of the specs."""
    from controller.cluster import MAX_HOSTS  # no Monarch, no namespaces: constants only

    nodes = trainer.nodes + rollout.engines * rollout.nodes
    hosts = args.cluster or nodes
    if hosts != nodes:
        raise ValueError(f"--cluster {hosts}, but the specs need {nodes} hosts ({trainer.nodes} "
                         f"trainer nodes + {rollout.engines * rollout.nodes} rollout nodes): "
                         f"give --cluster {nodes} or --cluster alone")
    if nodes > MAX_HOSTS:
        raise ValueError(f"--cluster: the specs need {nodes} hosts, more than the {MAX_HOSTS} "
                         f"an emulated cluster holds")


def attach_addresses(args, trainer: TrainerSpec, rollout: RolloutSpec
                     ) -> tuple[list[str], list[str]] | None:
    """--attach-trainers/--attach-rollouts, one address per node of each spec; None when not
    attaching (a cluster run fills them in once its hosts are up)."""
    from controller.launch import parse_addresses  # no Monarch until attach_procs

    if not (args.attach_trainers or args.attach_rollouts):
        return None
    if not (args.attach_trainers and args.attach_rollouts):
        raise ValueError("--attach-trainers and --attach-rollouts go together")
    t_addrs = parse_addresses(args.attach_trainers)
    r_addrs = parse_addresses(args.attach_rollouts)
    if len(t_addrs) != trainer.nodes:
        raise ValueError(f"--attach-trainers names {len(t_addrs)} workers, but the trainer "
                         f"spec has nodes={trainer.nodes}")
    if len(r_addrs) != rollout.engines * rollout.nodes:
        raise ValueError(f"--attach-rollouts names {len(r_addrs)} workers, but the rollout spec "
                         f"has engines*nodes={rollout.engines * rollout.nodes}")
    return t_addrs, r_addrs


TLS_FLAGS = ("tls_dir", "tls_ca", "tls_cert", "tls_key", "insecure")


def check_security(args, addresses, hosts: int) -> Security | None:
    """Multi-host runs are mutual TLS unless --insecure (controller/security.py): the files are
    found and checked here; a run on this host refuses the flags (it would ignore them)."""
    given = [f"--{n.replace('_', '-')}" for n in TLS_FLAGS if getattr(args, n)]
    if addresses is None and args.cluster is None:
        if given:
            raise ValueError(f"{', '.join(given)} only apply to multi-host runs (--attach-*, "
                             f"--cluster); this run spawns on this host: drop them")
        return None
    if args.cluster is not None:
        return cluster_security(args, hosts)
    security = resolve(tls_dir=args.tls_dir, ca=args.tls_ca, cert=args.tls_cert,
                       key=args.tls_key, insecure=args.insecure, name="controller")
    for a in addresses[0] + addresses[1]:
        security.check_address(a, "worker address")
    security.check_transport(os.environ)
    return security


def cluster_security(args, hosts: int) -> Security:
    """--cluster: --tls-dir DIR (files for the controller and every emulated host, made by
    controller.certs for their addresses) or --insecure."""
    from controller.cluster import CONTROLLER_ADDRESS, host_address  # constants, no namespaces

    names = [host_address(i) for i in range(hosts)]
    make = (f"python -m controller.certs make DIR --hosts {','.join(names)} --controller "
            f"{CONTROLLER_ADDRESS}")
    if args.tls_ca or args.tls_cert or args.tls_key:
        raise ValueError(f"--cluster takes its files from --tls-dir DIR (every emulated host "
                         f"needs its own): make them with `{make}`")
    if not (args.tls_dir or args.insecure):
        raise ValueError(f"--cluster runs authenticated (mutual TLS) unless told --insecure: "
                         f"make the files with `{make}` and pass --tls-dir DIR, or pass "
                         f"--insecure")
    security = resolve(tls_dir=args.tls_dir, ca=None, cert=None, key=None,
                       insecure=args.insecure, name="controller", env={})
    if args.tls_dir:
        for name in names + [CONTROLLER_ADDRESS]:
            creds = (Credentials.from_dir(args.tls_dir, name) if name != CONTROLLER_ADDRESS
                     else security.credentials)
            try:
                check_files(creds)
                Security(creds).check_named(name, "an emulated host")
            except ValueError as e:
                raise ValueError(f"--tls-dir {args.tls_dir} for emulated host {name}: {e} "
                                 f"(made with `{make}`?)") from None
    return security
