"""`GrpoTrainer`: one FSDP2 rank of an HF Qwen3 policy (fp32, gloo), trained with GRPO, sending
its weights through WeightBridge after every optimizer step.

The policy is HF transformers' ``Qwen3ForCausalLM``, the architecture the vLLM engine serves,
built from `examples.engines.models` ("qwen3") and sharded with ``fully_shard`` per decoder
layer and at the root. WeightBridge gets the FSDP2 shards' local tensors (named as the HF
checkpoint) and a loader that copies a full HF checkpoint's rows into them: the probe finds
the row shards, and the engine's loader the bf16 cast, so each update moves bf16 bytes.
"""

from __future__ import annotations

import time

import torch
from monarch.actor import Actor, current_rank, endpoint

from examples.engines import models, trainer_group
from weightbridge import CheckpointSpec, TensorSpec

MODEL = "qwen3"


def fp32_spec() -> CheckpointSpec:
    """The checkpoint an fp32 trainer writes: the model's HF names and shapes, float32."""
    return CheckpointSpec(tuple(TensorSpec(t.name, t.shape, "float32")
                                for t in models.checkpoint_spec(MODEL).tensors))


def policy_loss(model, tokens: torch.Tensor, adv: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """GRPO's on-policy loss: minus the advantage-weighted log-likelihood of the completions
    (one optimizer step per batch, so the importance ratio is 1 and there is no clipping)."""
    logits = model(input_ids=tokens).logits[:, prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, prompt_len:, None])
    return -(adv[:, None] * logp.squeeze(-1)).mean()


class GrpoTrainer(Actor):
    """One trainer rank; all ranks form one gloo group on 127.0.0.1:``master_port``."""

    def __init__(self, master_port: int, lr: float):
        torch.set_num_threads(1)
        self.master_port, self.lr = master_port, lr
        self.model = None

    @endpoint
    def setup(self, group) -> None:
        """Build the policy, shard it, and make this rank's sender (collective over the
        trainer mesh); `connect` loads checkpoint v0 (what the engine starts from)."""
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.rank, self.world = current_rank().rank, group.num_trainers
        self.own_group = trainer_group.init_group(self.rank, self.world, self.master_port)
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(**models.hf_config(MODEL))
        model = transformers.Qwen3ForCausalLM(cfg).float()
        names = {n for n, _ in model.named_parameters()}
        if names != {t.name for t in fp32_spec().tensors}:
            raise ValueError(f"transformers' Qwen3 names differ from the checkpoint's: "
                             f"{sorted(names ^ {t.name for t in fp32_spec().tensors})[:4]}")
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.params = {n: trainer_group.local(p) for n, p in self.model.named_parameters()}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr,
                                           weight_decay=0.0)
        self.adapter = group.sender(self.params, self._load, fp32_spec())

    def _load(self, weights) -> None:
        """Copy full HF tensors' rows into this rank's FSDP2 shards (``torch.chunk`` on dim 0,
        as FSDP2 cuts them). Any subset of tensors; nothing collective."""
        with torch.no_grad():
            for name, full in weights:
                target = self.params[name]
                chunks = torch.chunk(full, self.world, dim=0)
                piece = chunks[self.rank] if self.rank < len(chunks) else full[:0]
                target.copy_(piece.reshape(target.shape))

    @endpoint
    def connect(self) -> None:
        """Connect, then load checkpoint v0 through this rank's own loader: connect's probe
        overwrites the parameters, and by default keeps no copy of them
        (`TransferConfig.trainer_restore`)."""
        self.adapter.connect()
        self._load(models.checkpoint(MODEL, 0).items())

    @endpoint
    def train_and_send(self, tokens: list[list[int]], adv: list[float], prompt_len: int,
                       version: int) -> tuple[float, float]:
        """One GRPO step on this rank's share of the batch (every ``world``-th sequence),
        then ``send_weights(version)``. Returns (loss, send_weights' seconds)."""
        rows = slice(self.rank, None, self.world)
        batch = torch.tensor(tokens)[rows]
        loss = policy_loss(self.model, batch, torch.tensor(adv)[rows], prompt_len)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        start = time.monotonic()
        self.adapter.send_weights(version)
        return loss.item(), time.monotonic() - start

    @endpoint
    def send(self, version: int) -> None:
        """send_weights(version) of the weights as they are (the starting ones, after
        connect)."""
        self.adapter.send_weights(version)

    @endpoint
    def wait_sent(self) -> None:
        """Sender staging: wait until the staged versions have gone out."""
        if self.adapter.config.sender_staging:
            self.adapter.wait_idle()

    @endpoint
    def save(self, directory: str) -> None:
        """Write the full fp32 weights as an HF model directory (collective; rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            models.write_checkpoint_dir(MODEL, state, directory)

    @endpoint
    def close(self) -> None:
        import torch.distributed as dist

        if self.model is not None and self.own_group and dist.is_initialized():
            dist.destroy_process_group()
        self.model = None
