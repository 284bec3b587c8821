"""Generating vLLM engines updated by WeightBridge, proven by their own generations.

A trainer rank holding the HF checkpoint sends versions 1..3 to a generating vLLM engine
(`examples.engines.generating`: `vllm.LLM` in-process, one TP rank per Monarch proc, TP 2
through vLLM's ``external_launcher``). After each install the engine's greedy tokens and top-k
logprobs on fixed prompts must equal, exactly, those of a fresh engine that loaded the same
checkpoint from disk (in fresh processes); the previous version's reference must differ (the
check can fail). Qwen3-MoE: fused qkv, stacked and CPU-prepacked experts, padded vocabulary.

`test_lm_head_handle_serves_the_written_version` checks the derived copy alone: bytes written
into the parameters reach the logits only through the after-install step.
"""

import pytest

from conftest import run_ranks
from examples.engines import generating
from meshprocs import proc_pair
from weightbridge import TransferConfig

pytestmark = [pytest.mark.engines, pytest.mark.mesh]

MODEL, VERSIONS = "qwen3_moe", 3
MODES = {"sync": (False, False), "rs": (False, True)}
CASES = [(1, "sync"), (2, "sync"), (2, "rs")]


@pytest.fixture(scope="module")
def references():
    """(tp, version) -> a fresh engine's completions, built on first use."""
    cache: dict[tuple[int, int], list] = {}

    def get(tp: int, version: int) -> list:
        if (tp, version) not in cache:
            ranks = run_ranks(generating.reference_rank, tp, MODEL, version, timeout_s=300)
            assert all(r == ranks[0] for r in ranks), "a fresh engine's TP ranks disagree"
            cache[tp, version] = ranks[0]
        return cache[tp, version]

    return get


@pytest.mark.parametrize("tp,mode", CASES, ids=[f"tp{t}-{m}" for t, m in CASES])
def test_generations_after_updates_equal_a_fresh_engine_from_disk(tp, mode, references):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=generating.TIMEOUT_S, round_bytes=32 << 10,
                            sender_staging=ss, receiver_staging=rs)
    with proc_pair(1, tp, names=("ckpt", "vllm")) as procs:
        result = generating.run(procs, model=MODEL, tp=tp, versions=VERSIONS, config=config)
    for v in range(1, VERSIONS + 1):
        got, want = result.completions[v], references(tp, v)
        assert got == want, f"TP{tp} {mode} v{v}: generation differs from a fresh engine"
        if v > 1:  # negative control: the previous version's engine generates otherwise
            assert got != references(tp, v - 1), f"v{v} and v{v - 1} generate alike"


def _written_without_loader(rank, world_size, port, model, reference_bits, refresh):
    """An engine started from v0; v1's parameter bytes written straight into its tensors (as a
    transfer does, no loader); generate before and after ``after_update``."""
    import tempfile

    import torch

    from examples.engines import models
    from examples.engines.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory() as d:
        models.write_checkpoint_dir(model, models.checkpoint(model, 0), d)
        engine = VllmEngine(d, rank=rank, world_size=world_size, master_port=port)
    try:
        with torch.no_grad():
            for name, bits in reference_bits.items():
                target = engine.params[name].view(torch.uint8)
                target.copy_(torch.frombuffer(bytearray(bits), dtype=torch.uint8)
                             .view(target.shape))
        run = lambda: engine.generate(generating.PROMPTS, max_tokens=generating.MAX_TOKENS,  # noqa: E731
                                      logprobs=generating.TOP_K)
        stale = run()
        if refresh:
            engine.after_update(1)
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

        w = engine.model.lm_head.weight
        return stale, run(), bool(check_cpu_sgl_kernel(w.shape[0], w.shape[1], w.dtype))
    finally:
        engine.close()


def _fresh_bits(rank, world_size, port, model, version):
    """A fresh engine loaded from disk: its parameters' bytes and its completions."""
    import tempfile

    import torch

    from examples.engines import models
    from examples.engines.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory() as d:
        models.write_checkpoint_dir(model, models.checkpoint(model, version), d)
        engine = VllmEngine(d, rank=rank, world_size=world_size, master_port=port)
    try:
        # Plain bytes: tensors would cross the process boundary as shared memory that dies
        # with this process.
        bits = {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                for n, p in engine.params.items()}
        return bits, engine.generate(generating.PROMPTS, max_tokens=generating.MAX_TOKENS,
                                     logprobs=generating.TOP_K)
    finally:
        engine.close()


def test_lm_head_handle_serves_the_written_version():
    (fresh,) = run_ranks(_fresh_bits, 1, MODEL, 1)
    bits, want = fresh
    (got,) = run_ranks(_written_without_loader, 1, MODEL, bits, True)
    stale, refreshed, packed_copy = got
    assert refreshed == want, "after after_update the engine does not serve the written bytes"
    # Which path this host's vLLM takes for lm_head decides whether the step is needed here:
    # a packed copy (sgl-kernel's weight_packed_linear, on AVX-512 / AMX hosts) serves the old
    # values until rebuilt; oneDNN (AVX2) reads the live weight.
    print(f"lm_head: {'packed copy' if packed_copy else 'live weight'}; without the refresh "
          f"the engine served {'the written version' if stale == want else 'a stale lm_head'}")
    if packed_copy:
        assert stale != want, "a packed lm_head copy served the written bytes unrefreshed"
