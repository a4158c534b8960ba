"""`PolicyTrainer`: one DeepSpeed engine around a causal-LM MoE policy.

What it does: load a HF checkpoint (the project's HybridMoe or any HF MoE), wrap it in DeepSpeed
(ZeRO 0-3 from the spec; gloo on CPU, NCCL on GPU), compute old-policy logprobs (recording the
routes it used, for R2 replay), run RL steps with an injected objective (rl/objective.py; the math
lives in rl/algos), run SFT steps, export weights for sync, save and resume. Long sequences: logprobs
from the LM head in tiles (rl/trainer/tiled.py), activation checkpointing (rl/trainer/checkpointing.py),
micro-batches by a token budget (rl/trainer/batch.py `MicroBatching`), each sequence split over ranks
(rl/trainer/ulysses.py); docs/training.md, "Long sequences".

What it does not do: sample, grade, compute advantages, or talk to rollout workers; the driver
(rl/train.py) does, and passes tensors in. The class is plain Python so tests run it in-process;
rl/trainer/actor.py wraps it as a Ray actor.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from model.families import RouterHooks, family_of
from model.shipped import copy_tokenizer
from rl.log import get_logger
from rl.trainer import checkpointing, ulysses
from rl.trainer.engine import (check_resume_stage, deepspeed_config, init_distributed, keep_grad_norm,  # noqa: F401
                               load_policy, peak_rss_gb, reset_peak_rss)
from rl.trainer.batch import MicroBatching, TrainBatch, image_inputs, logits_window, micro_batches, stitch_rows, token_logprobs
from rl.trainer.freeze import freeze_bottom_layers
from rl.trainer.lora import LoraSpec
from rl.trainer.packing import (PrefixPack, logit_nodes, pack_micro_batch, pack_routes, packed_logprobs,  # noqa: F401
                                packing_enabled, unpack_routes)
from rl.trainer.tiled import head_inputs, tiled_packed_logprobs, tiled_token_logprobs, tiling_refusal
from rl.model_config import ModelSection
from rl.trainer.config import TrainerSection

log = get_logger("trainer")

Objective = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TrainerSpec:
    """What the trainer needs from the run config (kept small so tests can build one by hand)."""

    zero_stage: int | str = TrainerSection.zero_stage  # auto | 0..3 (rl/trainer/config.py resolve_zero_stage)
    lr: float = TrainerSection.lr
    weight_decay: float = TrainerSection.weight_decay
    grad_clip: float = TrainerSection.grad_clip
    warmup_steps: int = TrainerSection.warmup_steps
    micro_batch_size: int = TrainerSection.micro_batch_size
    dtype: str = ModelSection.dtype
    seed: int = ModelSection.seed
    routing_replay: str = ModelSection.routing_replay  # auto | r3 | r2 | off
    freeze_router_bias: bool = ModelSection.freeze_router_bias
    lora: LoraSpec = LoraSpec()  # rank 0: full fine-tuning; else only peft adapters train (rl/trainer/lora.py)
    frozen_layers: int = TrainerSection.frozen_layers  # the input embeddings and decoder layers [0, N) do not train (rl/trainer/freeze.py)
    prefix_sharing: str = TrainerSection.prefix_sharing  # auto | on | off: pack a group's shared prompt as a token tree (rl/trainer/packing.py)
    logprob_tile_tokens: int = TrainerSection.logprob_tile_tokens  # logprobs from the head in tiles of this many tokens (rl/trainer/tiled.py); 0: full logits
    activation_checkpointing: str = TrainerSection.activation_checkpointing  # off | on | auto (rl/trainer/checkpointing.py)
    max_tokens_per_micro_batch: int = TrainerSection.max_tokens_per_micro_batch  # > 0: micro-batches by padded tokens, not rows (rl/trainer/batch.py MicroBatching)
    sequence_parallel_size: int = TrainerSection.sequence_parallel_size  # > 1: each sequence split over this many ranks (rl/trainer/ulysses.py)

    @property
    def micro(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_tokens_per_micro_batch)


def supports_routing_replay(m: torch.nn.Module) -> bool:
    """HybridMoe replays through its forward; the HF MoE families of model/families.py through router hooks."""
    fam = family_of(m.config)
    return fam is not None and fam.supported and fam.replay in ("native", "hooks")


def router_hooks(m: torch.nn.Module) -> RouterHooks | None:
    """Replay / recording hooks on an HF MoE model's routers (None for HybridMoe, dense and unknown models)."""
    fam = family_of(m.config)
    return RouterHooks(m, fam) if fam is not None and fam.supported and fam.replay == "hooks" else None


class PolicyTrainer:
    def __init__(self, model_dir: str | os.PathLike[str], spec: TrainerSpec, objective: Objective | None = None,
                 rank: int = 0, world_size: int = 1, master_port: int | None = None, total_steps: int = 1000,
                 master_addr: str | None = None) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed

        torch.manual_seed(spec.seed + rank)
        self.spec = spec
        self.objective = objective
        self.rank = rank
        self.world_size = world_size
        init_distributed(rank, world_size, master_addr=master_addr or "127.0.0.1", master_port=master_port)
        self.sp = ulysses.setup(spec.sequence_parallel_size, rank, world_size)
        self.model_dir = str(model_dir)
        module = load_policy(model_dir, spec.dtype)
        ulysses.prepare_model(module.config, self.sp, spec.prefix_sharing, "policy")
        if spec.lora.enabled:  # before anything holds the module: the peft wrapper is the policy from here on
            from rl.trainer.lora import apply_lora

            module = apply_lora(module, spec.lora)
        self.reference_is_base = False
        self.replay_supported = supports_routing_replay(module)
        self.family = family_of(module.config)
        self._hooks: dict[int, RouterHooks | None] = {id(module): router_hooks(module)}
        if hasattr(module.config, "freeze_expert_bias"):  # RL practice: the aux-free selection bias stays put
            module.config.freeze_expert_bias = spec.freeze_router_bias
        self.frozen_params = freeze_bottom_layers(module, spec.frozen_layers)
        self._packs: dict[int, bool] = {id(module): self.sp is None and packing_enabled(spec.prefix_sharing, module.config, "policy")}
        self._tiles: dict[int, bool] = {id(module): tiling_refusal(module.config) is None}
        rec = self._hooks[id(module)].recomputing if self._hooks[id(module)] else None  # (hooks record no recompute)
        self._ckpt: dict[int, bool] = {id(module): checkpointing.prepare(module, spec.activation_checkpointing, "policy", rec)}
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
        ds_config = deepspeed_config(spec.micro_batch_size, spec.grad_clip, spec.zero_stage, spec.dtype)
        warm = max(0, spec.warmup_steps)

        def lr_lambda(step: int) -> float:
            return min(1.0, (step + 1) / warm) if warm else 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        keep_grad_norm(self.engine)
        self.step_count = 0
        self.version = 0
        self.reference: torch.nn.Module | None = None

    def load_reference(self, model_dir: str | os.PathLike[str]) -> None:
        """Freeze the checkpoint at `model_dir` as the KL reference (pi_ref).

        The reference is a plain module in this process, in the trainer's dtype, with no gradients
        and no optimizer state: on one rank it adds the weights once (no Adam moments), about a
        third of what the trainable copy costs in fp32 with AdamW. It is not sharded across ranks.
        """
        ref = load_policy(model_dir, self.spec.dtype)
        ulysses.prepare_model(ref.config, self.sp, self.spec.prefix_sharing, "reference")
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        self._hooks[id(ref)] = router_hooks(ref)
        self._packs[id(ref)] = self.sp is None and packing_enabled(self.spec.prefix_sharing, ref.config, "reference")
        self._tiles[id(ref)] = tiling_refusal(ref.config) is None
        self.reference = ref

    def use_base_reference(self) -> None:
        """LoRA: the KL reference is this policy with its adapters switched off, i.e. the frozen base.
        Equal to the initial policy only while the adapters are at their zero init (the caller checks);
        costs no memory at all."""
        if not self.spec.lora.enabled:
            raise RuntimeError("use_base_reference needs trainer.lora.rank > 0")
        self.reference, self.reference_is_base = self.module, True

    # ------------------------------------------------------------------ forward helpers
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _pack_of(self, mb: TrainBatch, module: torch.nn.Module | None) -> PrefixPack | None:
        """The micro-batch packed as token trees, or None to run it padded (`pack_micro_batch`)."""
        m = module if module is not None else self.module
        return pack_micro_batch(mb, m.config) if self._packs.get(id(m), False) else None

    def _pass(self, mb: TrainBatch, *, replay_BTLK: torch.Tensor | None, router_logits: bool,
              module: torch.nn.Module | None = None) -> tuple[object, torch.Tensor, PrefixPack | None]:
        """One micro-batch's forward and the logprobs [B, T] of its targets (at least every loss-masked one),
        shared-prefix packed where `_pack_of` allows; the pack (or None) maps the forward's per-token outputs
        (router logits, routes) back to the rows. The logprobs come from the head in tiles
        (`trainer.logprob_tile_tokens`, rl/trainer/tiled.py) where the model allows it, and a training forward
        is activation-checkpointed as `trainer.activation_checkpointing` says."""
        pack = self._pack_of(mb, module)
        m = module if module is not None else self.module
        tile = self.spec.logprob_tile_tokens if self._tiles.get(id(m), False) else 0
        shard = ulysses.current()
        if self._ckpt.get(id(m), False):
            n = pack.shape[0] * pack.shape[1] if pack is not None else mb.input_ids_BT.numel() // (shard.size if shard else 1)
            on = checkpointing.wanted(self.spec.activation_checkpointing, n, m.config)
            if self.spec.activation_checkpointing == "auto":
                on = checkpointing.on_every_rank(m, on)
            checkpointing.set_active(m, on)
        if shard is not None:  # this rank's part of a sequence-parallel group's micro-batch (rl/trainer/ulysses.py)
            out, lp = ulysses.sharded_logprobs(self._run, m, mb, shard, replay_BTLK, router_logits, module, tile)
            return out, lp, None
        ids, lmask = mb.input_ids_BT, mb.loss_mask_BT
        with head_inputs(m) if tile else nullcontext((None, None)) as (head, hidden):
            if pack is None:
                out = self._forward(mb, replay_BTLK=replay_BTLK, router_logits=router_logits, module=module)
            else:
                keep_K, rows_M = logit_nodes(pack, lmask)
                kw = dict(input_ids=pack.input_ids_PN, attention_mask=pack.attention_mask_P1NN,
                          position_ids=pack.position_ids_PN, logits_to_keep=keep_K)
                replay = pack_routes(replay_BTLK, pack) if replay_BTLK is not None else None
                out = self._run(kw, replay_BTLK=replay, router_logits=router_logits, module=module)
        if pack is None:
            lp = tiled_token_logprobs(head, hidden[0], ids, tile) if tile else token_logprobs(out.logits, ids)
        elif tile:
            lp = tiled_packed_logprobs(head, hidden[0], rows_M, ids, lmask, tile)
        else:
            lp = packed_logprobs(out.logits, pack, keep_K, rows_M, ids, lmask)
        return out, lp, pack

    def _forward(self, batch: TrainBatch, *, replay_BTLK: torch.Tensor | None, router_logits: bool,
                 module: torch.nn.Module | None = None):
        # Logits only where a loss-masked target needs them (the prompt carries no loss).
        kw = dict(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                  logits_to_keep=logits_window(batch.loss_mask_BT))
        kw.update(self._image_inputs(batch))
        return self._run(kw, replay_BTLK=replay_BTLK, router_logits=router_logits, module=module)

    def _run(self, kw: dict, *, replay_BTLK: torch.Tensor | None, router_logits: bool,
             module: torch.nn.Module | None = None):
        """The model call with router recording / replay set up; `replay_BTLK` in the layout of `kw`'s rows."""
        hooks = self._hooks_of(module)
        if router_logits and hooks is None:  # HF families: the router hooks record the logits
            kw["output_router_logits"] = True
        replay_LNK = None
        if self.replay_supported and replay_BTLK is not None:
            B, T, L, K = replay_BTLK.shape
            replay_LNK = replay_BTLK.permute(2, 0, 1, 3).reshape(L, B * T, K)  # [B, T, L, k] -> [L, B*T, k]
        if hooks is None:
            if replay_LNK is not None:  # HybridMoe: padding (-1) replays expert 0, which no trained token reads
                kw["routed_experts"] = replay_LNK.clamp_min(0)
            return (module or self.engine)(**kw)
        hooks.clear()
        hooks.set_replay(replay_LNK)  # padding (-1) takes the router's own choice
        try:
            return (module or self.engine)(**kw)
        finally:
            if not torch.is_grad_enabled():  # else an activation-checkpointed backward replays them again (train_step clears)
                hooks.set_replay(None)

    def _image_inputs(self, batch: TrainBatch) -> dict:
        return image_inputs(batch, self.module.config, "policy")

    def _hooks_of(self, module: torch.nn.Module | None) -> RouterHooks | None:
        return self._hooks.get(id(module if module is not None else self.module))

    def _router_logits(self, out) -> list[torch.Tensor] | None:
        """Per MoE layer router logits [B*T, E] of the last forward of the policy (with their graph)."""
        hooks = self._hooks_of(None)
        lg = hooks.router_logits() if hooks is not None else getattr(out, "router_logits", None)
        return lg if lg is None else [ulysses.gather_tokens(x, 0) for x in lg]  # sequence parallel: the whole micro-batch's

    def _routes_used_LNK(self, out, router_logits) -> torch.Tensor | None:
        """The expert ids the forward actually used, [L, B*T, k] (for the router terms and R2)."""
        hooks = self._hooks_of(None)
        if hooks is not None:  # recorded by the router hooks: exact for group-limited (DeepSeek-V3) routers too
            return ulysses.gather_tokens(hooks.used_LNK(), 1)
        r = getattr(out, "routed_experts", None)
        if r is not None:
            return ulysses.gather_tokens(r, 1)
        if not router_logits:
            return None
        k = int(getattr(self.module.config, "num_experts_per_tok", 2))
        return torch.stack([lg.topk(k, dim=-1).indices for lg in router_logits])

    def routing_mode(self, batch: TrainBatch) -> str:
        """r3: replay the engine's routes; r2: replay routes the trainer recorded (or will record
        in `compute_logprobs`) under the old policy; off: route freely."""
        mode = self.spec.routing_replay
        if not self.replay_supported or mode == "off":
            return "off"
        if batch.routes_from == "engine" and mode in ("auto", "r3"):
            return "r3"
        if mode == "r3":
            return "off"  # R3 asked for but the engine reported no routes; logged by the caller
        return "r2"

    def _micro_batches(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> Iterator[tuple[TrainBatch, bool]]:
        """The micro-batches to run; with sequence parallelism each is padded and run as this rank's part of it."""
        mbs = micro_batches(batch, self.spec.micro, n_micro, pad_only)
        return iter(mbs) if self.sp is None else ulysses.shard_micro_batches(mbs, self.sp)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old-policy logprobs [B, T] and, when R2 replay applies, the routes used [B, T, L, k]."""
        self.engine.eval()
        mode = self.routing_mode(batch)
        out_lp, out_routes = [], []
        for mb, padding in self._micro_batches(batch, n_micro, pad_only):
            out, lp, pack = self._pass(mb, replay_BTLK=mb.routed_experts_BTLK if mode == "r3" else None, router_logits=False)
            if padding:
                continue
            out_lp.append(lp)
            if mode == "r2":
                B, T = mb.input_ids_BT.shape
                r_LNK = self._routes_used_LNK(out, None)
                out_routes.append(unpack_routes(r_LNK, pack) if pack is not None
                                  else r_LNK.reshape(r_LNK.shape[0], B, T, -1).permute(1, 2, 0, 3))
        self.engine.train()
        if not out_lp:  # a padding-only shard
            return batch.loss_mask_BT[:0].clone(), None
        size = self.spec.micro
        lp = stitch_rows(out_lp, batch, size)
        routes = stitch_rows(out_routes, batch, size, fill=-1) if out_routes else None
        return lp, routes

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference-policy logprobs [B, T] of the batch's tokens. Where the policy replays routes
        (R3 from the engine, R2 recorded by `compute_logprobs`), the reference replays the same
        ones, so the KL compares the two policies on the experts the tokens were generated with."""
        if self.reference is None:
            raise RuntimeError("reference_logprobs: no reference model is loaded (load_reference first)")
        replay = self.routing_mode(batch) != "off" and batch.routed_experts_BTLK is not None
        out = []
        from contextlib import nullcontext

        with self.module.disable_adapter() if self.reference_is_base else nullcontext():
            for mb, _ in self._micro_batches(batch):
                _, lp, _ = self._pass(mb, replay_BTLK=mb.routed_experts_BTLK if replay else None, router_logits=False,
                                      module=self.reference)
                out.append(lp)
        return stitch_rows(out, batch, self.spec.micro)

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> dict[str, float]:
        """One optimizer step of the RL objective over the batch (micro-batched).

        With N ranks `batch` is this rank's shard of the step batch; its loss weights and step totals
        are the whole batch's, so the shard losses add up to the one-rank loss. DeepSpeed averages
        gradients over the data-parallel ranks, hence the backward of `world_size x loss`.
        """
        if self.objective is None:
            raise RuntimeError("PolicyTrainer.train_step needs an objective")
        t0 = time.perf_counter()
        reset_peak_rss()
        self.engine.train()
        mode = self.routing_mode(batch)
        B = 0 if pad_only else batch.num_seqs
        step_seqs = batch.step_seqs or batch.num_seqs
        metrics: dict[str, float] = {}
        n_mb = 0
        tele = self._moe_telemetry()
        fwd_lp: list[torch.Tensor] = []  # pi_old's logprobs: this forward runs the policy that made them
        fwd_tokens = 0  # positions the forwards computed, padding included (packed: tree nodes)
        for mb, padding in self._micro_batches(batch, n_micro, pad_only):
            replay = mb.routed_experts_BTLK if mode in ("r3", "r2") else None
            out, lp, pack = self._pass(mb, replay_BTLK=replay, router_logits=True)
            if not padding:
                fwd_lp.append(lp.detach())
                fwd_tokens += pack.shape[0] * pack.shape[1] if pack is not None else mb.input_ids_BT.numel()
            router_logits = self._router_logits(out)
            routes_LNK = self._routes_used_LNK(out, router_logits)
            hooks = self._hooks_of(None)
            fresh = ulysses.gather_tokens(hooks.fresh_LNK(), 1) if hooks is not None and replay is not None else None
            counts = not padding and (self.sp is None or self.sp.rank == 0)  # a sequence-parallel group counts once
            if counts and tele is not None and routes_LNK is not None and router_logits:
                tele.add(pack.tokens(mb.domains) if pack is not None else mb, routes_LNK.detach(),
                         [lg.detach() for lg in router_logits], replayed=replay is not None, fresh_routes_LNK=fresh)
            elif not counts and tele is not None and routes_LNK is not None:
                tele.add_padding(mb.domains, routes_LNK)
            # The objective's weights come from the whole step batch, so micro-batch losses just add up.
            # Packed, the router terms average over the tree's nodes: a shared prompt token counts once.
            loss, m = self.objective(lp, mb, router_logits, routes_LNK,
                                     token_mask_N=pack.real_PN.reshape(-1) if pack is not None else None)
            idx_loss = getattr(out, "indexer_loss", None)
            if idx_loss is not None:  # DSA indexer (its input is detached inside the model)
                coef = float(getattr(self.module.config, "indexer_loss_coef", 0.0))
                loss = loss + coef * idx_loss * (mb.num_seqs / step_seqs)
                m["dsa/indexer_loss"] = float(ulysses.group_sum(idx_loss))  # sequence parallel: the ranks' parts
            if padding:
                loss = loss * 0.0  # keeps the collective backward in step, adds nothing
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            if padding:
                continue
            weight = mb.num_seqs / B
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * weight
            n_mb += 1
        self.engine.step()
        hooks = self._hooks_of(None)
        if hooks is not None:
            hooks.clear()  # the last micro-batch's router logits hold its graph
            hooks.set_replay(None)
        grad_norm = self._grad_norm()
        self._expert_bias_step()
        self.step_count += 1
        self.version += 1
        if tele is not None:  # every rank: `finish` all-reduces over the ranks
            moe = tele.finish()  # per-domain expert load, router entropy, replay mismatch
            if not pad_only:
                metrics.update(moe)
        if not pad_only and fwd_lp:
            from rl.algos.kl import kl_per_token
            from rl.observe.telemetry import logprob_gap_metrics

            old_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else stitch_rows(fwd_lp, batch, self.spec.micro)
            mask_BT = batch.loss_mask_BT > 0
            metrics.update(logprob_gap_metrics(old_BT, batch.rollout_logprobs_BT, mask_BT, batch.domain_ids_B, batch.domains))
            if batch.ref_logprobs_BT is not None:
                # KL(pi_old || pi_ref) on the step's generated tokens, k3 (Schulman 2020), before the update.
                kl_BT, _ = kl_per_token(old_BT, batch.ref_logprobs_BT, mask_BT, "k3")
                metrics["kl/ref_mean"] = float(kl_BT.sum() / mask_BT.sum().clamp_min(1))
        step_s = time.perf_counter() - t0
        tokens = 0.0 if pad_only else float(batch.attention_mask_BT.sum())
        metrics.update({
            "train/grad_norm": grad_norm,
            "train/lr": float(self.scheduler.get_last_lr()[0]) if self.scheduler else self.spec.lr,
            "train/micro_batches": float(n_mb),
            "train/step_s": step_s,
            "train/tokens": tokens,
            "train/tokens_per_s": tokens / max(step_s, 1e-9),
            "train/peak_rss_gb": peak_rss_gb(),  # this rank's peak resident memory during the update
            "train/forward_tokens": float(fwd_tokens),
            "train/seqs": float(B),
            "train/routing_replay_" + mode: 1.0,
        })
        return ulysses.follower_metrics(metrics, self.sp)

    def sft_step(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> dict[str, float]:
        """Supervised step: mean NLL of the loss-masked (assistant) tokens of the whole step batch
        (this rank's shard with the step's totals, as in `train_step`)."""
        self.engine.train()
        total_tokens = max(float(batch.step_loss_tokens or batch.loss_mask_BT.sum()), 1.0)
        step_seqs = batch.step_seqs or batch.num_seqs
        nll_sum = 0.0
        for mb, padding in self._micro_batches(batch, n_micro, pad_only):
            out, lp, _ = self._pass(mb, replay_BTLK=None, router_logits=False)
            loss = -(lp * mb.loss_mask_BT).sum() / total_tokens
            aux = getattr(out, "aux_loss", None)
            if aux is not None:
                loss = loss + float(getattr(self.module.config, "router_aux_loss_coef", 0.0)) * aux * (mb.num_seqs / step_seqs)
            if padding:
                loss = loss * 0.0
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            nll_sum += float(loss.detach())
        self.engine.step()
        grad_norm = self._grad_norm()
        self.step_count += 1
        self.version += 1
        return ulysses.follower_metrics({"sft/nll": nll_sum, "sft/grad_norm": grad_norm,
                                         "train/seqs": 0.0 if pad_only else float(batch.num_seqs)}, self.sp)

    def _expert_bias_step(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): move each expert's selection bias by the sign of its
        load error, from the loads summed over all data-parallel ranks. No-op when frozen."""
        m = self.module
        if not hasattr(m, "update_expert_bias"):
            return
        loads = m.accumulated_expert_load()
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)
        m.update_expert_bias(loads=loads)

    def _moe_telemetry(self):
        cfg, fam = self.module.config, self.family
        key = fam.num_experts_key if fam is not None and fam.is_moe else "num_experts"
        n_exp = getattr(cfg, key, None) or getattr(cfg, "num_local_experts", None)
        if not n_exp:
            return None
        from rl.observe.moe import MoeStepTelemetry, router_biases

        scoring = fam.scoring if fam is not None and fam.replay == "hooks" else getattr(cfg, "scoring_func", "softmax")
        return MoeStepTelemetry(int(n_exp), scoring=scoring, bias_LE=router_biases(self.module))

    def set_lr(self, lr: float) -> None:
        """Change the base learning rate (e.g. SFT warm start vs RL); the schedule's shape is kept."""
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _grad_norm(self) -> float:
        """Pre-clipping global grad norm of the step just taken (DeepSpeed computes it across ranks)."""
        g = self.engine.get_global_grad_norm()
        return float(g) if g is not None else float("nan")

    # ------------------------------------------------------------------ weights & checkpoints
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) parameters and buffers by trainer name, on CPU, for weight sync.
        With LoRA: the adapted weights merged (base names) and the buffers, all that a sync changes."""
        import deepspeed

        if self.spec.lora.enabled:
            from rl.trainer.lora import merged_named_weights

            yield from merged_named_weights(self.module, zero3=self.spec.zero_stage == 3)
            return

        for name, p in self.module.named_parameters():
            if self.spec.zero_stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    yield name, p.detach().cpu().clone()
            else:
                yield name, p.detach().cpu()
        for name, b in self.module.named_buffers():
            if b is not None and b.is_floating_point():
                yield name, b.detach().cpu()

    def save_hf(self, out_dir: str | os.PathLike[str]) -> str:
        """A HF checkpoint (config + safetensors) of the current weights: what rollout engines load.
        Rank 0 writes it; under ZeRO-3 the other ranks take part in the parameter gathers."""
        if self.spec.lora.enabled:
            return self._save_hf_lora(Path(out_dir))
        if self.rank != 0:
            if self.spec.zero_stage == 3:
                for _ in self.named_weights():
                    pass
            return ""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.spec.zero_stage == 3:
            sd = dict(self.named_weights())
            self.module.save_pretrained(out, state_dict=sd)
        else:
            self.module.save_pretrained(out)
        copy_tokenizer(out, src=self.model_dir)
        return str(out)

    # ------------------------------------------------------------------ LoRA (rl/trainer/lora.py)
    @property
    def sync_module(self) -> torch.nn.Module:
        """What the weight exporter reads config and persistent names from (base names under LoRA)."""
        if not self.spec.lora.enabled:
            return self.module
        from rl.trainer.lora import BaseNames

        if self.__dict__.get("_base_names") is None:
            self._base_names = BaseNames(self.module)
        return self._base_names

    def adapter_bucket(self):
        """The adapter alone (`AdapterBucket`) for an adapter-only sync; rank 0's, the others join the gathers."""
        from rl.trainer.lora import adapter_bucket, adapter_state

        zero3 = self.spec.zero_stage == 3
        if self.rank != 0:
            if zero3:
                adapter_state(self.module, zero3)
            return None
        return adapter_bucket(self.module, self.version, zero3)

    def _save_hf_lora(self, out: Path) -> str:
        """A plain HF checkpoint of the merged policy (what `jointrl eval` / serve load), plus the adapter
        alone in `out/adapter/` (peft's format)."""
        from rl.trainer.lora import adapter_state, merged_named_weights, save_adapter

        zero3 = self.spec.zero_stage == 3
        sd = dict(merged_named_weights(self.module, zero3=zero3, everything=True))
        if self.rank != 0:
            if zero3:
                adapter_state(self.module, zero3)
            return ""
        out.mkdir(parents=True, exist_ok=True)
        self.module.get_base_model().save_pretrained(out, state_dict=sd)
        save_adapter(self.module, str(out / "adapter"), zero3)
        copy_tokenizer(out, src=self.model_dir)
        return str(out)

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str], client_state: dict | None = None) -> None:
        state = dict(client_state or {})
        state.update({"step_count": self.step_count, "version": self.version, "torch_rng": torch.get_rng_state()})
        # Every rank: its shards. LoRA: the frozen base is left out (it is the run's init checkpoint).
        self.engine.save_checkpoint(str(ckpt_dir), tag="state", client_state=state,
                                    exclude_frozen_parameters=self.spec.lora.enabled)
        if self.rank == 0:
            (Path(ckpt_dir) / "trainer_meta.json").write_text(json.dumps({"step_count": self.step_count, "version": self.version}))

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> dict:
        check_resume_stage(self.engine, ckpt_dir, "state")
        _, state = self.engine.load_checkpoint(str(ckpt_dir), tag="state", load_module_strict=not self.spec.lora.enabled)
        state = state or {}
        self.step_count = int(state.get("step_count", 0))
        self.version = int(state.get("version", 0))
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        return state
