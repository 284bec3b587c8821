"""A generating vLLM engine (`vllm.LLM`) whose every TP rank lives in the caller's process.

`VllmEngine` is one TP rank of a real vLLM engine that generates: build one per Monarch proc of
a rollout engine (TP 1: one proc; TP 2: two procs, each building its rank), hand ``params``
(the live tensors vLLM serves from) and ``load_weights`` (vLLM's own in-place reload) to
``group.receiver(...)``, and wire ``before_update`` / ``after_update`` as the receiver's hooks.
Nothing of vLLM is patched: the engine uses three of vLLM's own switches.

- **In-process ranks** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the engine core and its worker
  run in this process, so the parameters are here, where WeightBridge's RDMA buffers are.
- **TP > 1 across procs**: vLLM's ``external_launcher`` executor, the torchrun-style mode:
  each proc builds one rank from ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` (set here from
  ``rank``, ``world_size`` and ``master_port``); every rank runs its own scheduler, so every
  rank must call `generate` with the same prompts and sampling settings (vLLM's scheduling is
  deterministic; the ranks meet in the TP collectives). It is given as a subclass (vLLM takes
  an ``Executor`` class there) that rendezvous at ``tcp://MASTER_ADDR:MASTER_PORT`` instead of
  ``env://``: the CPU build names each engine's shared-memory TP segment after the init
  method's port, and ``env://`` gives every engine on a host the same name (a second engine
  fails with ``create shm in SHMManager failed. errno: 17``).
- **A model loader of our own** (vLLM's ``register_model_loader``, chosen per engine by
  ``load_format``): vLLM's safetensors loader, plus `vllm_steps.keep_linear_weights` between
  building the model and its first post-load step, so linear layers keep live weights. It
  reads the checkpoint the engine starts from on disk, as any deployment does.

Derived state: ``after_update`` re-runs lm_head's post-load step (`vllm_steps.refresh_derived`;
a packed copy on AMX / AVX-512 hosts), ``before_update`` drops the prefix cache (KV computed
with the old weights). See docs/engines.md.

Typical usage, inside a rollout actor (one per proc)::

    engine = VllmEngine(model_dir, rank=r, world_size=2, master_port=port)
    adapter = group.receiver(engine.params, engine.load_weights, spec,
                             before_update_hook=engine.before_update,
                             after_update_hook=engine.after_update)
    adapter.connect() ... adapter.poll_requests()   # between generate() calls
    outs = engine.generate([[2, 3, 4]], max_tokens=8, logprobs=5)   # greedy, top-5
    engine.close()
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Sequence

import torch

from examples.engines import vllm_steps

LOAD_FORMAT = "weightbridge_live"
"""The load format `VllmEngine` gives vLLM: `_LiveWeightsLoader`, registered on first use."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated sequence: its tokens, their logprobs, and the top-k at each position."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The sampled token's logprob at each position (as vLLM computed it, float32)."""
    top: tuple[tuple[tuple[int, float], ...], ...]
    """At each position, (token, logprob) of the ``logprobs`` most likely tokens, by rank."""


class VllmEngine:
    """One TP rank of a generating `vllm.LLM`, built in this process.

    Args:
        model_dir: a directory with ``config.json`` and the safetensors checkpoint the engine
            starts from (no tokenizer needed: prompts are token ids).

    Keyword Args:
        rank: this process's TP rank; world_size: the engine's TP degree.
        master_port: the engine's rendezvous port on 127.0.0.1 (one per engine; also names
            vLLM's shared-memory TP communicator).
        dtype: the engine's weight dtype. seed: vLLM's sampling seed.
        kv_cache_bytes: the KV cache (host memory on CPU).
        max_model_len: prompt plus generated tokens, at most.
    """

    def __init__(self, model_dir: str, *, rank: int = 0, world_size: int = 1,
                 master_port: int, dtype: str = "bfloat16", seed: int = 0,
                 kv_cache_bytes: int = 64 << 20, max_model_len: int = 128) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside an engine of TP {world_size}; pass "
                             f"0 <= rank < world_size")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"{model_dir} has no config.json: give the directory of the "
                             f"checkpoint the engine starts from (models.write_checkpoint_dir)")
        _register_loader()
        _set_process_env(rank, world_size, master_port)
        from vllm import LLM

        self.rank, self.world_size = rank, world_size
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                       enforce_eager=True, max_model_len=max_model_len,
                       load_format=LOAD_FORMAT, tensor_parallel_size=world_size,
                       distributed_executor_backend=(_tcp_external_launcher() if world_size > 1
                                                     else None),
                       kv_cache_memory_bytes=kv_cache_bytes, enable_prefix_caching=True)
        self.vllm_config = self.llm.llm_engine.vllm_config
        self.model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        self.params: dict[str, torch.Tensor] = dict(self.model.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload (the probed loader; it rebuilds derived state itself,
        `vllm_steps.reload`). Collective under TP: every rank calls it with the same tensors."""
        vllm_steps.reload(self.model, self.vllm_config, weights)

    def before_update(self, version: int) -> None:
        """The receiver's ``before_update_hook``: drop the prefix cache (KV of old weights)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM refused to reset its prefix cache before installing "
                               f"version {version} (requests still running?): poll between "
                               f"generate() calls, never during one")

    def after_update(self, version: int) -> None:
        """The receiver's ``after_update_hook``: rebuild what vLLM derived from the weights."""
        vllm_steps.refresh_derived(self.model)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, logprobs: int = 0,
                 seed: int | Sequence[int] | None = None) -> list[Completion]:
        """Generate one completion per token-id prompt.

        ``seed``: one for every request, or one per prompt (sampling is then fixed per
        request, whatever else runs in the batch). Under TP every rank must call it with the
        same arguments at the same step.
        """
        from vllm import SamplingParams

        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed, "
                             f"or one per prompt")
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 logprobs=logprobs or None, seed=s, ignore_eos=True,
                                 detokenize=False) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        return [_completion(o.outputs[0], logprobs) for o in outs]

    def close(self) -> None:
        """Shut the engine down and destroy vLLM's process groups."""
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        del self.llm, self.model, self.params
        destroy_model_parallel()
        destroy_distributed_environment()


def _completion(out, k: int) -> Completion:
    ids = tuple(out.token_ids)
    chosen, top = [], []
    for token, at in zip(ids, out.logprobs or [{}] * len(ids)):
        chosen.append(at[token].logprob if token in at else float("nan"))
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in at.items() if lp.rank <= k)
        top.append(tuple((t, lp) for _, t, lp in ranked))
    return Completion(ids, tuple(chosen), tuple(top))


def _set_process_env(rank: int, world_size: int, master_port: int) -> None:
    """The environment vLLM reads for an in-process engine rank (before `vllm.LLM`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU worker binds OpenMP threads to cores it picks; several engines and trainers
    # share this host's cores, so leave placement to the OS unless the user chose.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if world_size > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))


def _tcp_external_launcher():
    """vLLM's ``external_launcher`` executor, rendezvous on ``tcp://`` (module docstring)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class TcpExternalLauncher(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            init, rank, local_rank = super()._distributed_args()
            return (f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rank,
                    local_rank)

    return TcpExternalLauncher


_REGISTERED = False


def _register_loader() -> None:
    """Register `_LiveWeightsLoader` under `LOAD_FORMAT` (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class _LiveWeightsLoader(DefaultModelLoader):
        """vLLM's safetensors loader; linear layers keep live weights
        (`vllm_steps.keep_linear_weights` before the first post-load step)."""

        def __init__(self, load_config: LoadConfig):
            super().__init__(dataclasses.replace(load_config, load_format="safetensors"))

        def create_model(self, *args, **kwargs):
            model = super().create_model(*args, **kwargs)
            vllm_steps.keep_linear_weights(model)
            return model

    register_model_loader(LOAD_FORMAT)(_LiveWeightsLoader)
    _REGISTERED = True
