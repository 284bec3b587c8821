"""Layout-discovery benchmark: probe a Qwen3-MoE-shaped rollout worker (TP2 x EP2).

    .venv/bin/python benchmarks/bench_probe.py            # ~200M-element bf16 model
    .venv/bin/python benchmarks/bench_probe.py --layers 2 # quicker
    .venv/bin/python benchmarks/bench_probe.py --layers 2 --device emulated-cuda
    .venv/bin/python benchmarks/bench_probe.py --sweep    # the scaling table (probe_sweep)
    .venv/bin/python benchmarks/bench_probe.py --restart  # cached maps: restart connect time
    .venv/bin/python benchmarks/bench_probe.py --tiny --wbridge-path /tmp/wbridge
                                                # tiny loaders: ours against wbridge 0.1.0

Prints, measured in one run: probe time / one plain load_weights call (target <= 6), peak extra
memory during the probe / parameter bytes (target <= 1.0), source-map bytes (target <= 1 MB) and
the number of copy operations (pieces). ``--device emulated-cuda`` puts the parameters on the
emulated CUDA device (`weightbridge.testing.emulated_cuda`) and probes them as a trainer of a
transfer group does (`TransferWorker.on_source_map`: probe, then restore its weights from a host
copy, or with ``--trainer-restore none`` not at all; no source map cache), printing the peak
extra *device* memory / parameter bytes (target <= 0.25; its times include the
emulation's overhead and say nothing about a GPU). The loader is written in the vLLM style:
fused qkv and gate_up shards, experts stacked into 3-D params on their expert-parallel rank,
vocabulary padded to a multiple of 64.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import load  # noqa: E402
from benchmarks.probe_restart import run_restart  # noqa: E402
from benchmarks.probe_sweep import HEADER, PeakRss, measure, run_sweep  # noqa: E402
from benchmarks.probe_tiny import measure as measure_tiny  # noqa: E402
from benchmarks.probe_tiny import run_tiny  # noqa: E402
from meshes.qwen3_moe import MoEConfig, RolloutShard, checkpoint_spec
from weightbridge import TransferConfig, extract_source_map
from weightbridge.config import TRAINER_RESTORES
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.worker import TransferWorker
from weightbridge.testing import emulated_cuda
from weightbridge.types import Placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=MoEConfig.layers)
    parser.add_argument("--repeats", type=int, default=3, help="plain-load timing repeats")
    parser.add_argument("--device", choices=("cpu", "emulated-cuda"), default="cpu")
    parser.add_argument("--trainer-restore", choices=TRAINER_RESTORES,
                        default=TransferConfig().trainer_restore,
                        help="emulated-cuda, --restart: how a probed trainer gets its weights "
                        "back (default: TransferConfig's)")
    parser.add_argument("--sweep", action="store_true",
                        help="the scaling table: rank sizes x TP x devices (probe_sweep)")
    parser.add_argument("--restart", action="store_true",
                        help="first and restart connect of a controller run (probe_restart)")
    parser.add_argument("--model", default="small", help="--restart: the demo model size")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny loaders: ours against wbridge 0.1.0's probe (probe_tiny)")
    parser.add_argument("--wbridge-path", help="--tiny: a folder holding the wbridge package "
                        "(pip install --target DIR wbridge==0.1.0 --no-deps)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one sweep row: device,mib,tp,split
    parser.add_argument("--tiny-row", help=argparse.SUPPRESS)  # one tiny row: impl,loader
    args = parser.parse_args()
    if args.row:
        device, mib, tp, split = args.row.split(",")
        print("ROW " + json.dumps(measure(device, float(mib), int(tp), split)))
        return
    if args.tiny_row:
        impl, kind = args.tiny_row.split(",")
        print("ROW " + json.dumps(measure_tiny(impl, kind)))
        return
    if args.tiny:
        print(f"load before: {load()}")
        for line in run_tiny(__file__, args.wbridge_path):
            print(line)
        print(f"load after: {load()}")
        return
    if args.restart:
        print(f"load before: {load()}")
        for line in run_restart(args.model, args.trainer_restore):
            print(line)
        print(f"load after: {load()}")
        return
    if args.sweep:
        print(f"load before: {load()}")
        print(HEADER)
        run_sweep(__file__)
        print(f"load after: {load()}")
        return
    config = MoEConfig(layers=args.layers)
    spec = checkpoint_spec(config)
    emulated = args.device == "emulated-cuda"
    if emulated:
        emulated_cuda.activate()
    worker = RolloutShard(config, tp=2, tp_rank=1, ep=2, ep_rank=1,
                          device="cuda" if emulated else "cpu")
    param_bytes = sum(p.numel() * p.element_size() for p in worker.params.values())
    print(f"model: {spec.numel / 1e6:.1f}M elements in {len(spec)} tensors; worker TP2 x EP2 "
          f"rank (tp 1, ep 1): {len(worker.params)} params, {param_bytes / 2**20:.1f} MiB")

    torch.set_num_threads(torch.get_num_threads())
    def probe():
        return extract_source_map(worker.params, worker.load_weights, spec)

    if emulated:  # as a trainer of a group probes: restoring its weights afterwards
        group_worker = TransferWorker("trainer", worker.params, worker.load_weights, spec,
                                      rank=0, placement=Placement("trainer"),
                                      transport=LocalControl().transport,
                                      config=TransferConfig(
                                          trainer_restore=args.trainer_restore,
                                          source_map_cache=None))
        def probe():  # noqa: F811 (this path probes as a group's trainer)
            return group_worker.on_source_map()[0]

        device_base = emulated_cuda.memory.current
        emulated_cuda.memory.reset_peak()
    base = PeakRss.now()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        smap = probe()
        probe_s = time.perf_counter() - t0
    extra = rss.peak - base
    device_extra = emulated_cuda.memory.peak - device_base if emulated else None

    gen = torch.Generator().manual_seed(1)
    checkpoint = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    load_s = min(_timed(lambda: worker.load_weights(checkpoint.items()))
                 for _ in range(args.repeats))
    map_bytes = len(pickle.dumps(smap))
    print(smap.summary())
    print(f"probe time {probe_s:.2f} s / plain load_weights {load_s:.3f} s = "
          f"{probe_s / load_s:.2f} (target <= 6"
          f"{'; emulated device: not a GPU time' if emulated else ''})")
    print(f"peak extra {'host ' if emulated else ''}memory {extra / 2**20:.1f} MiB / parameter "
          f"bytes {param_bytes / 2**20:.1f} MiB = {extra / param_bytes:.2f} (target <= 1.0)")
    if emulated:
        print(f"peak extra device memory (emulated CUDA) {device_extra / 2**20:.1f} MiB / "
              f"parameter bytes {param_bytes / 2**20:.1f} MiB = "
              f"{device_extra / param_bytes:.2f} (target <= 0.25)")
    print(f"source map {map_bytes / 1024:.1f} KiB pickled (target <= 1024 KiB); "
          f"copy operations (pieces): {len(smap.pieces)}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
