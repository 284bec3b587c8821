"""A zoo of weight loaders written in the styles of real engines, for layout-discovery tests.

Each case is a function ``build(scale=1, ...) -> Worker``: the worker's params (or a callable
returning the live params), its ``load_weights``, the `CheckpointSpec` it reads, a factory of
pseudo-random checkpoints, and the case's own expectations on the source map (`Expect`). Cases
take their rank as a keyword, so tests can build every rank of one layout.

Typical usage::

    from zoo import CASES
    worker = CASES["vllm_llama_tp2"]()
    smap = weightbridge.extract_source_map(worker.params, worker.load_weights, worker.spec)

Modules by style: `megatron` (TP / EP / PP bridges), `fsdp` (FSDP1 flat params, torchtitan
FSDP2 x TP), `vllm_style` and `vllm_mla` (vLLM / SGLang
weight_loaders over `vllm_layers`), `misc` (kernel layouts, replacing
loaders, non-contiguous params, odd reading orders).
"""

from . import fsdp, megatron, misc, vllm_mla, vllm_style
from .common import Expect, Worker, random_checkpoint, random_tensor

CASES = {**megatron.CASES, **fsdp.CASES, **vllm_style.CASES, **vllm_mla.CASES, **misc.CASES}

__all__ = ["CASES", "Expect", "Worker", "random_checkpoint", "random_tensor"]
