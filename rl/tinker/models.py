"""What a Tinker training client and a sampling client run on: a LoRA policy trainer and a shared vLLM engine.

`TrainingModel`: one `PolicyTrainer` (rl/trainer/policy.py: DeepSpeed, ZeRO stage 0, one rank in this
process, peft LoRA adapters from rl/trainer/lora.py) with its own AdamW state. `forward_backward`
adds one request's gradients (the loss is a sum, so requests and micro-batches add up) and
`optim_step` applies them with the request's Adam parameters, clipping the global norm first when
asked. `sampler_snapshot` is the sync's export (rl/weights: `export_buckets` of the merged policy,
the path a LoRA trainer's merged sync takes); `save_state` / `load_state` are DeepSpeed checkpoints
(adapters and optimizer moments; the frozen base is the served checkpoint).

`SamplerEngine`: one `RolloutEngine` (rl/rollout/engine.py) for every sampling client. It holds one set
of weights at a time; a sample for another snapshot waits until the engine's in-flight requests are
done, then loads that snapshot through `update_weights` (the in-process form of a rollout worker's
sync) and runs.

What this module does not do: HTTP, queues, ownership or request validation (rl/tinker/service.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from rl.tinker.losses import tinker_loss

PAD_ID = 0  # padding positions are masked out of the attention and the loss


@dataclass(frozen=True)
class Datum:
    """One validated Tinker datum: model input tokens [N] and its loss inputs, each [N]."""

    tokens: np.ndarray  # int64 [N]
    inputs: Mapping[str, np.ndarray]  # name -> [N] (target_tokens int64; the rest float32)


@dataclass(frozen=True)
class AdamStep:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0: no clipping


@dataclass(frozen=True)
class LoraRequest:
    rank: int
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool


def lora_targets(model_dir: str, req: LoraRequest) -> tuple[str, ...]:
    """rl/trainer/lora.py target groups for Tinker's flags: attention -> `attention`; MLP -> `mlp` (dense and shared-expert
    MLPs) and `experts` (routed experts), whichever the model has. The unembedding is never adapted (see docs/tinker.md)."""
    from rl.trainer.engine import load_policy
    from rl.trainer.lora import find_targets

    want = (["attention"] if req.train_attn else []) + (["mlp", "experts"] if req.train_mlp else [])
    with torch.device("meta"):
        try:
            m = load_policy(model_dir)
        except Exception:  # some checkpoints refuse meta loading; a real load is slower but equal
            m = None
    if m is None:
        m = load_policy(model_dir)
    found = []
    for group in want:
        try:
            find_targets(m, (group,))
            found.append(group)
        except ValueError:
            continue
    return tuple(found)


class TrainingModel:
    """A LoRA policy with its optimizer; every method runs on its client's worker thread."""

    def __init__(self, model_dir: str, lora: LoraRequest, targets: tuple[str, ...], micro_batch_size: int = 8) -> None:
        from rl.trainer.lora import LoraSpec
        from rl.trainer.policy import PolicyTrainer, TrainerSpec

        spec = TrainerSpec(zero_stage=0, lr=1e-4, grad_clip=0.0, micro_batch_size=micro_batch_size, dtype="float32",
                           seed=lora.seed, routing_replay="off", lora=LoraSpec(rank=lora.rank, targets=targets),
                           prefix_sharing="off", logprob_tile_tokens=0, activation_checkpointing="off")
        self.trainer = PolicyTrainer(model_dir, spec)
        self.lora = lora
        self.targets = targets
        self.pending_grads = False

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainer.module.parameters() if p.requires_grad]

    def _logprobs(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """log p(targets_BT[b, t] | ids_BT[b, :t + 1]) for every position (fp32 log-softmax of the logits)."""
        out = self.trainer.engine(input_ids=ids_BT, attention_mask=mask_BT)
        logits_BTV = out.logits.float()
        return torch.log_softmax(logits_BTV, dim=-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float | str],
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum outputs (`logprobs`, `elementwise_loss`, float32 [N]) and metrics (`loss:sum`), adding the
        gradients of the summed loss unless `forward_only`."""
        t0 = time.perf_counter()
        mb = max(1, self.trainer.spec.micro_batch_size)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        tokens = 0
        self.trainer.engine.train(not forward_only)
        for s in range(0, len(data), mb):
            chunk = data[s:s + mb]
            T = max(len(d.tokens) for d in chunk)
            B = len(chunk)
            ids = torch.full((B, T), PAD_ID, dtype=torch.long)
            mask = torch.zeros((B, T), dtype=torch.long)
            inputs: dict[str, torch.Tensor] = {}
            for b, d in enumerate(chunk):
                n = len(d.tokens)
                ids[b, :n] = torch.from_numpy(d.tokens)
                mask[b, :n] = 1
                for k, v in d.inputs.items():
                    dst = inputs.setdefault(k, torch.zeros((B, T), dtype=torch.long if k == "target_tokens" else torch.float32))
                    dst[b, :n] = torch.from_numpy(np.asarray(v))
            targets = inputs.pop("target_tokens")
            with torch.no_grad() if forward_only else torch.enable_grad():
                lp_BT = self._logprobs(ids, mask, targets)
                loss, per_BT = tinker_loss(loss_fn, lp_BT, inputs, mask, config)
            if not forward_only:
                self.trainer.engine.backward(loss, scale_wrt_gas=False)
                self.pending_grads = True
            total += float(loss.detach())
            tokens += int(mask.sum())
            lp = lp_BT.detach()
            for b, d in enumerate(chunk):
                n = len(d.tokens)
                outputs.append({"logprobs": lp[b, :n].numpy().astype(np.float32),
                                "elementwise_loss": per_BT[b, :n].numpy().astype(np.float32)})
        dt = time.perf_counter() - t0
        return outputs, {"loss:sum": total, "tokens:sum": float(tokens), "seconds:max": dt}

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step (decoupled weight decay) with the request's parameters on the gradients added so far."""
        params = self.trainable
        max_norm = step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)) \
            if any(p.grad is not None for p in params) else 0.0
        self.trainer.set_lr(step.learning_rate)
        for g in self.trainer.optimizer.param_groups:
            g["betas"] = (step.beta1, step.beta2)
            g["eps"] = step.eps
            g["weight_decay"] = step.weight_decay
        self.trainer.engine.step()
        self.trainer.step_count += 1
        self.trainer.version += 1
        self.pending_grads = False
        return {"grad_norm:mean": grad_norm, "step:max": float(self.trainer.step_count)}

    def sampler_snapshot(self) -> list:
        """The merged policy as the sync sends it to engines: `WeightBucket`s of every weight, base names."""
        from rl.trainer.lora import merged_named_weights
        from rl.weights.exporter import export_buckets

        pairs = merged_named_weights(self.trainer.module, everything=True)
        return export_buckets(self.trainer.sync_module, pairs, copy=True)

    def logprobs_of(self, tokens: Sequence[int]) -> np.ndarray:
        """The trainer's log p(tokens[t] | tokens[:t]) for t >= 1 (the sync check's trainer side)."""
        ids = torch.tensor([list(tokens)[:-1]], dtype=torch.long)
        with torch.no_grad():
            lp = self._logprobs(ids, torch.ones_like(ids), torch.tensor([list(tokens)[1:]], dtype=torch.long))
        return lp[0].numpy()

    def save_state(self, out_dir: Path) -> None:
        self.trainer.save_checkpoint(out_dir)

    def load_state(self, ckpt_dir: Path, optimizer: bool) -> None:
        self.trainer.engine.load_checkpoint(str(ckpt_dir), tag="state", load_module_strict=False,
                                            load_optimizer_states=optimizer, load_lr_scheduler_states=optimizer)
        if not optimizer:  # weights only: fresh moments, as a new training client would have
            for st in self.trainer.optimizer.state.values():
                st.clear()

    def close(self) -> None:
        self.trainer = None  # type: ignore[assignment]


def base_weights(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The served checkpoint's own weights (checkpoint names), to put the base model back into the engine."""
    from safetensors.torch import load_file

    pairs: list[tuple[str, torch.Tensor]] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        pairs += list(load_file(str(f)).items())
    return pairs


class SamplerEngine:
    """One vLLM engine shared by every sampling client, holding one snapshot's weights at a time."""

    def __init__(self, engine, model_dir: str) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self._cv = threading.Condition()
        self._loaded = "base"
        self._inflight = 0
        self.swaps = 0

    def _load(self, key: str, buckets: list | None) -> None:
        from rl.weights.wire import unpack_bucket

        if buckets is None:
            pairs = base_weights(self.model_dir)
        else:
            pairs = [p for b in buckets for p in unpack_bucket(b)]
        self.engine.update_weights(pairs)
        self.swaps += 1

    def run(self, key: str, buckets: list | None, fn: Callable[[object], object]) -> object:
        """`fn(engine)` with snapshot `key` (`buckets`; None: the base checkpoint) loaded in the engine."""
        with self._cv:
            while self._loaded != key and self._inflight:
                self._cv.wait()
            if self._loaded != key:
                self._load(key, buckets)
                self._loaded = key
            self._inflight += 1
        try:
            return fn(self.engine)
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()

    def shutdown(self) -> None:
        self.engine.shutdown()
