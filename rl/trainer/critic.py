"""The PPO critic: a scalar value head on its own copy of the policy, trained with the clipped value loss.

Why a separate copy and not a head on the policy's trunk: the policy's gradient then stays exactly
what the RL objective says (no value-regression gradient through shared weights, in particular none
into the MoE routers, whose balance the policy's router terms and routing replay manage), the critic
can take its own learning rate, and the policy checkpoint the engines load is untouched by it. The
cost is a second set of weights and Adam moments per rank; the head starts at zero, so the first
values are 0 and the first advantages are plain discounted returns. (OpenRLHF and verl make the
same choice for PPO.)

`values(batch)` gives V(s_t) for every target position t, aligned like `token_logprobs`: the value of
the state before token t is read off the hidden state at t - 1 (`values_BT[:, 0] = 0`).
`value_step(batch)` takes one optimizer step of `rl.algos.clipped_value_loss` against
`batch.returns_BT`, with the step batch's aggregation weights (global with N ranks, like the policy).

Images: a batch with images (`TrainBatch.images_B` / `image_mask_BT`) is read with its `pixel_values` and
`image_mask` in every forward of the critic, exactly as the policy trainer feeds its forwards, so the critic
values the state the policy acted in (`image_inputs`).

Shared-prefix packing: with `prefix_sharing` ('auto' | 'on' | 'off', the run's `trainer.prefix_sharing`)
each micro-batch's groups run as token trees (rl/trainer/packing.py) where the model's family allows it and
`should_pack` finds it cheaper, exactly as the policy's forwards do; the values are the padded forward's, to
float round-off. Batches with images run padded.

What it does not do: compute advantages or returns (the driver does, with `rl.algos`), or replay
routes (the critic's MoE routes freely).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rl.trainer import checkpointing
from rl.trainer.batch import MicroBatching, TrainBatch, image_inputs, micro_batches, stitch_rows
from rl.trainer.engine import check_resume_stage, deepspeed_config, keep_grad_norm, load_policy
from rl.trainer.packing import PrefixPack, pack_micro_batch, packed_values, packing_enabled
from rl.trainer.tiled import head_inputs
from rl.model_config import ModelSection
from rl.objective import AlgorithmSection
from rl.trainer.config import TrainerSection


@dataclass(frozen=True)
class CriticSpec:
    lr: float = TrainerSection.critic_lr
    value_clip: float = AlgorithmSection.value_clip  # <= 0: plain squared error
    weight_decay: float = TrainerSection.weight_decay
    grad_clip: float = TrainerSection.grad_clip
    zero_stage: int | str = TrainerSection.zero_stage  # auto | 0..3 (rl/trainer/config.py resolve_zero_stage)
    micro_batch_size: int = TrainerSection.micro_batch_size
    dtype: str = ModelSection.dtype
    prefix_sharing: str = TrainerSection.prefix_sharing  # auto | on | off, as the policy's (rl/trainer/packing.py)
    activation_checkpointing: str = TrainerSection.activation_checkpointing  # off | on | auto, as the policy's (rl/trainer/checkpointing.py)
    max_tokens_per_micro_batch: int = TrainerSection.max_tokens_per_micro_batch  # as the policy's (rl/trainer/batch.py MicroBatching)

    @property
    def micro(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_tokens_per_micro_batch)


class ValueModel(nn.Module):
    """A causal LM trunk with a zero-initialised scalar head on its final (normed) hidden states."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        hidden = int(lm.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pack: PrefixPack | None = None,
                **image_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [B, T] aligned to targets, a zero-valued term that ties the unused LM head into the graph).
        `pack`: the rows as token trees (`pack_prefixes`), run instead of the padded rows.
        `image_kw`: `pixel_values` and `image_mask` for a batch with images (`image_inputs`), else nothing.
        The final hidden states are taken at the LM head's input (`head_inputs`, which cuts the LM head to one
        position): the model keeps no list of every layer's hidden states, as `output_hidden_states` would."""
        with head_inputs(self.lm) as (_, seen):
            if pack is not None:
                out = self.lm(input_ids=pack.input_ids_PN, attention_mask=pack.attention_mask_P1NN,
                              position_ids=pack.position_ids_PN)
            else:
                out = self.lm(input_ids=input_ids, attention_mask=attention_mask, **image_kw)
        if pack is not None:
            v_PN = self.head(seen[0].to(self.head.weight.dtype)).squeeze(-1).float()
            return packed_values(v_PN, pack), out.logits.float().sum() * 0.0
        h_BTD = seen[0]
        v_BT = self.head(h_BTD.to(self.head.weight.dtype)).squeeze(-1).float()
        values_BT = torch.zeros_like(v_BT)
        values_BT[:, 1:] = v_BT[:, :-1]  # V(s_t) from the state after tokens < t
        # DeepSpeed expects a gradient (possibly zero) for every trainable parameter it manages.
        return values_BT, out.logits.float().sum() * 0.0


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 for a perfect critic, 0 for one no better
    than a constant, negative for a worse one. Of the values the advantages were computed with."""
    r, v = returns_BT[mask_BT].double(), values_BT[mask_BT].double()
    var_r = float(r.var(unbiased=False)) if r.numel() else 0.0
    return 1.0 - float((r - v).var(unbiased=False)) / var_r if var_r > 0 else 0.0


class CriticTrainer:
    """One rank's critic engine (the process group is already up: the policy trainer started it)."""

    def __init__(self, model_dir: str | os.PathLike[str], spec: CriticSpec, world_size: int = 1) -> None:
        import deepspeed

        self.spec = spec
        self.world_size = world_size
        module = ValueModel(load_policy(model_dir, spec.dtype))
        self.packs = packing_enabled(spec.prefix_sharing, module.lm.config, "critic")
        self.checkpoints = checkpointing.prepare(module.lm, spec.activation_checkpointing, "critic")
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=spec.lr,
                                      weight_decay=spec.weight_decay, betas=(0.9, 0.95))
        ds_config = deepspeed_config(spec.micro_batch_size, spec.grad_clip, spec.zero_stage, spec.dtype)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
        keep_grad_norm(self.engine)

    def _image_inputs(self, mb: TrainBatch) -> dict[str, Any]:
        return image_inputs(mb, self.engine.module.lm.config, "critic's model")

    def _micro_batches(self, batch: TrainBatch, n_micro: int, pad_only: bool) -> list[tuple[TrainBatch, bool]]:
        return micro_batches(batch, self.spec.micro, n_micro, pad_only)

    def _values(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's forward on one micro-batch, packed where the model and the batch allow it."""
        lm = self.engine.module.lm
        pack = pack_micro_batch(mb, lm.config) if self.packs else None
        if self.checkpoints:
            n = pack.shape[0] * pack.shape[1] if pack is not None else mb.input_ids_BT.numel()
            checkpointing.set_active(lm, checkpointing.wanted(self.spec.activation_checkpointing, n, lm.config))
        if pack is not None:
            return self.engine(mb.input_ids_BT, mb.attention_mask_BT, pack=pack)
        return self.engine(mb.input_ids_BT, mb.attention_mask_BT, **self._image_inputs(mb))

    @torch.no_grad()
    def values(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> torch.Tensor:
        self.engine.eval()
        out = []
        for mb, padding in self._micro_batches(batch, n_micro, pad_only):
            v, _ = self._values(mb)
            if not padding:
                out.append(v * (mb.loss_mask_BT > 0))
        self.engine.train()
        return stitch_rows(out, batch, self.spec.micro) if out else batch.loss_mask_BT[:0].clone()

    def value_step(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> dict[str, float]:
        """One optimizer step on the clipped value loss (Andrychowicz et al. 2021's PPO2 form)."""
        from rl.algos import clipped_value_loss

        if batch.returns_BT is None or batch.values_BT is None:
            raise ValueError("value_step needs batch.values_BT (the values the advantages used) and batch.returns_BT")
        t0 = time.perf_counter()
        self.engine.train()
        clip = self.spec.value_clip if self.spec.value_clip > 0 else None
        loss_sum, clipfrac, n_tok = 0.0, 0.0, 0.0
        for mb, padding in self._micro_batches(batch, n_micro, pad_only):
            v, tie = self._values(mb)
            loss, m = clipped_value_loss(v, mb.values_BT, mb.returns_BT, mb.loss_mask_BT > 0, clip=clip,
                                         weights_BT=mb.loss_weights_BT)
            loss = loss + tie
            if padding:
                loss = loss * 0.0
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            if padding:
                continue
            tok = float((mb.loss_mask_BT > 0).sum())
            loss_sum += float(m["vf/loss"])  # the step-batch weights make the micro-batch losses add up
            clipfrac += m["vf/clipfrac"] * tok
            n_tok += tok
        self.engine.step()
        g = self.engine.get_global_grad_norm()
        out = {"value/loss": loss_sum, "value/clipfrac": clipfrac / max(n_tok, 1.0),
               "value/grad_norm": float(g) if g is not None else float("nan"), "value/step_s": time.perf_counter() - t0}
        if not pad_only:
            out["value/explained_var"] = explained_variance(batch.values_BT, batch.returns_BT, batch.loss_mask_BT > 0)
        return out

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> None:
        self.engine.save_checkpoint(str(ckpt_dir), tag="critic")

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> None:
        check_resume_stage(self.engine, ckpt_dir, "critic")
        self.engine.load_checkpoint(str(ckpt_dir), tag="critic")
