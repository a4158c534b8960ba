"""The `trainer` section of the run config (with its `trainer.lora` subsection): the DeepSpeed trainer ranks,
the optimizer, SFT and checkpoints, weight sync.

Declared here, once, with every key's default; rl/config.py composes it into RunConfig (YAML, dotted
overrides, coercion, cross-section checks). `TrainerSpec`, `CriticSpec` and `LoraSpec` take their defaults
from these fields. `check_lora` holds the `trainer.lora` checks. Nothing here starts a trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl.errors import ConfigError

@dataclass
class LoraSection:
    """LoRA adapters on the policy (rl/trainer/lora.py, docs/training.md "LoRA"); rank 0 = full fine-tuning."""

    rank: int = 0  # adapter rank r (1..512); 0 = no adapters, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input while training; must be 0 with the 'experts' target
    # any of: attention (q/k/v/o and gated-delta in/out projections), mlp (dense and shared-expert MLPs),
    # experts (the fused expert tensors of MoE layers, one rank-r pair per expert)
    targets: list[str] = field(default_factory=lambda: ["attention"])
    # auto: the adapter alone where the engines can serve it (vLLM LoRA requests), else merged weights
    # (only the adapted tensors); adapter: refuse at start-up where impossible; merged: always merge
    sync: Literal["auto", "adapter", "merged"] = "auto"


@dataclass
class TrainerSection:
    """DeepSpeed trainer."""

    num_workers: int = 1  # DeepSpeed ranks, one Ray actor each in one placement group (rl/trainer/group.py)
    cpus_per_rank: float = 1.0  # Ray resources of each rank's bundle
    gpus_per_rank: float = 0.0  # > 0: NCCL between ranks; 0: gloo on CPU
    # A custom Ray resource every rank's bundle requires ("" = none): ranks go only to nodes started
    # with it, NODE_RESOURCE_UNIT each (see rollout.node_resource)
    node_resource: str = ""
    # DeepSpeed ZeRO stage. auto: 0 on one rank, 1 on several. On one rank ZeRO-1/2 shard nothing and only add
    # buffers (a flat fp32 copy of the weights and gradient buckets: ~3 GB for a 373M-parameter fp32 model,
    # docs/training.md "Long sequences"); the update is the same.
    zero_stage: Literal["auto", 0, 1, 2, 3] = "auto"
    lr: float = 1e-5
    critic_lr: float = 1e-5  # algorithm.advantage = gae
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    micro_batch_size: int = 4
    steps: int = 10
    sft_steps: int = 0
    sft_lr: float = 1e-3
    sft_tasks_per_domain: int = 0  # train tasks whose reference solutions make the SFT set; 0 = max(4, 4 x tasks_per_step)
    # A JSONL file of demonstrations (assistant turns per train task, rl/sft.py) that replaces the references
    # as the SFT set, used as given whatever it scores; "" = the references. Relative to the working directory.
    sft_data: str = ""
    tasks_per_step: int = 4
    async_mode: bool = False  # updates overlap later steps' rollouts
    max_staleness: int = 1  # async mode: at most this many updates run behind the rollouts (policy-version lag <= k)
    sync_bucket_mb: int = 64
    sync_format: Literal["fp32", "bf16", "mxfp4"] = "fp32"
    # auto: /dev/shm when every rollout worker shares the trainer's node (and it has room), else Ray's
    # object store; $JOINTRL_SYNC_TRANSPORT overrides (docs/rollout.md, weight sync). nccl (GPU only,
    # untested on a GPU so far): rank 0 broadcasts into the workers' GPUs (rl/rollout/nccl_sync.py)
    sync_transport: Literal["auto", "shm", "object_store", "nccl"] = "auto"
    checkpoint_every: int = 0  # 0 = only at the end
    resume: bool = True
    lora: LoraSection = field(default_factory=LoraSection)
    # The input embeddings and the first N decoder layers do not train (with tied embeddings the LM head
    # neither): backward stops at layer N and no optimizer moments are kept for them. 0 = all train.
    frozen_layers: int = 0
    # Shared-prefix packing of the policy, reference and critic forwards (rl/trainer/packing.py): a GRPO group's
    # rows become one token tree, so the prompt they share is computed once; exact, not an approximation.
    # auto: on where the model's attention takes a tree mask (model/families.py `packs`) and a micro-batch
    # costs less packed; on: the same, but a model that cannot pack is a start-up error; off: padded rows.
    prefix_sharing: Literal["auto", "on", "off"] = "auto"
    # torch intra-op threads of each trainer rank. In sync mode on a CPU machine the engines idle while the
    # trainer works, so the trainer may take every core (docs/training.md, "Knobs on 2 cores").
    threads_per_rank: int = 1
    # Long sequences (docs/training.md, "Long sequences"). Per-token logprobs from the LM head in tiles of this
    # many tokens, each recomputed in the backward (rl/trainer/tiled.py): memory stays one tile's logits at any
    # length; 0 = the model's full logits.
    logprob_tile_tokens: int = 1024
    # Decoder layers keep only their inputs and re-run in the backward (rl/trainer/checkpointing.py), policy and
    # critic. auto: only micro-batches whose estimated activations pass 4 GiB (short sequences keep their speed).
    activation_checkpointing: Literal["off", "on", "auto"] = "auto"
    # > 0: micro-batches hold as many rows as fit this many padded tokens (rows x longest row; a longer row runs
    # alone), whatever trainer.micro_batch_size says; 0 = trainer.micro_batch_size rows each.
    max_tokens_per_micro_batch: int = 0
    # Ulysses sequence parallelism (rl/trainer/ulysses.py): each sequence is split over this many consecutive trainer
    # ranks (activations per rank / N; two all-to-alls per attention layer); trainer.num_workers / N groups split the
    # batch. Must divide trainer.num_workers; 1 = off.
    sequence_parallel_size: int = 1


def resolve_zero_stage(zero_stage: int | str, world_size: int) -> int:
    """The ZeRO stage a trainer of `world_size` ranks runs for `trainer.zero_stage` (`auto`: 0 alone, else 1)."""
    if zero_stage == "auto":
        return 0 if world_size <= 1 else 1
    return int(zero_stage)


def check_lora(lora: LoraSection, sync_transport: str) -> None:
    """`trainer.lora` against itself and the weight-sync transport (peft's and vLLM's limits), each error naming the key."""
    from rl.trainer.lora import LORA_TARGETS

    if not 0 <= lora.rank <= 512:
        raise ConfigError(f"config key 'trainer.lora.rank': value {lora.rank} is not allowed; allowed values: 0 (no LoRA) "
                          "or 1..512 (vLLM's largest max_lora_rank)")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        raise ConfigError(f"config key 'trainer.lora.alpha': value {lora.alpha} must be > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"config key 'trainer.lora.dropout': value {lora.dropout} must be in [0, 1)")
    bad = [t for t in lora.targets if t not in LORA_TARGETS]
    if bad or not lora.targets or len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(f"config key 'trainer.lora.targets': {lora.targets!r} is not allowed; allowed values: a non-empty "
                          f"list without repeats of {', '.join(repr(t) for t in LORA_TARGETS)}")
    if sync_transport == "nccl":
        raise ConfigError("config key 'trainer.lora.rank': LoRA is not supported with trainer.sync_transport=nccl "
                          "(the NCCL path broadcasts full tensors); use 'auto', 'shm' or 'object_store'")
    if "experts" in lora.targets and lora.dropout:
        raise ConfigError("config key 'trainer.lora.dropout': must be 0 when trainer.lora.targets includes 'experts' "
                          "(peft's wrapper for fused expert tensors has no dropout)")
