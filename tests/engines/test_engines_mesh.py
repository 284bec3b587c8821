"""torchtitan trainers -> vLLM engines on real Monarch meshes (`examples/engines/transfer.py`).

Four trainer procs run torchtitan (one gloo group) and two vLLM engines of TP 2 run on four
rollout procs (a gloo group each). Neither side's layout is known to WeightBridge: every rank
probes its own engine's loader. After each update every rollout parameter must equal, bit for
bit, what vLLM's own load of the same checkpoint gives. Fresh procs per case: vLLM and
torch.distributed keep process-global state.
"""

import pytest

from examples.engines import transfer
from meshprocs import proc_pair

pytestmark = [pytest.mark.engines, pytest.mark.mesh]

CASES = {
    "qwen3_moe FSDP2xTP -> 2 x TP2 EP": dict(model="qwen3_moe",
                                            trainer={"dp_shard": 2, "tp": 2},
                                            expert_parallel=True),
    "deepseek_v3 FSDP2xEP -> 2 x TP2": dict(model="deepseek_v3",
                                           trainer={"dp_shard": 4, "ep": 2},
                                           expert_parallel=False),
}
TRAINERS, ENGINES, ENGINE_TP = 4, 2, 2


@pytest.fixture
def procs():
    with proc_pair(TRAINERS, ENGINES * ENGINE_TP, names=("titan", "vllm")) as meshes:
        yield meshes


@pytest.mark.parametrize("case", list(CASES))
def test_titan_to_vllm_updates_are_bit_exact(case, procs):
    # 32 KiB rounds: several rounds per update, so both arenas of every worker are reused.
    report = transfer.run(procs, engines=ENGINES, engine_tp=ENGINE_TP, updates=2,
                          round_bytes=32 << 10, **CASES[case])
    print("\n".join(report.lines()))
    assert report.params_checked > 0
    assert report.mismatched == [[], []]
    # The byte accounting: every stage line and a non-zero unique volume.
    assert "unique needed" in report.plan_summary and "receive:" in report.plan_summary
