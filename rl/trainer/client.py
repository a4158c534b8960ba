"""The driver's side of the policy trainer: token batches in, typed results out.

`PolicyClient` wraps the trainer ranks (rl/trainer/group.py: TrainerGroup) with what the driver asks of
them: `collate` a step's groups into one padded batch with the step's aggregation weights, the critic's
`values`, `submit` an update (non-blocking; `PendingUpdate.finish()` waits for its `TrainResult`), the KL
reference (`prepare_reference`, the in-reward penalty `penalise_kl`), supervised steps and checkpoints.
It reads the `algorithm` section and `model.reference`.

It does not compute advantages (rl/train.py with rl/algos) or move weights to the engines (rl/sync.py).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rl.log import get_logger
from rl.types import Episode, RolloutGroup, SftStepResult, TrainResult

if TYPE_CHECKING:
    from rl.objective import AlgorithmSection

log = get_logger("trainer.client")


@dataclass(frozen=True)
class PendingUpdate:
    """One update running (or queued) on the trainer ranks; `finish()` waits for it."""

    trainer: Any  # rl.trainer.group.TrainerGroup
    refs: list[Any]  # one Ray object ref per rank
    staleness: int  # policy versions between the oldest episode's generator and the weights it trains

    def finish(self) -> TrainResult:
        return replace(self.trainer.wait(self.refs), staleness=self.staleness)


class PolicyClient:
    def __init__(self, trainer: Any, algorithm: AlgorithmSection, *, reference: str, run_dir: Path, pad_token_id: int,
                 domains: Sequence[str], lora: Any = None) -> None:
        self.trainer = trainer  # rl.trainer.group.TrainerGroup
        self.algorithm = algorithm  # the `algorithm` section
        self.reference = reference  # model.reference: a checkpoint, or "initial"
        self.run_dir = Path(run_dir)
        self.pad_token_id = pad_token_id
        self.domains = list(domains)
        self.lora = lora  # rl.trainer.lora's plan, None without LoRA
        self._ref_cache: dict[tuple[int, ...], Any] = {}
        self._next_update_version: int | None = None  # read from the trainer when nothing is in flight

    # ------------------------------------------------------------------ batches and updates
    def batch_of(self, episodes: Sequence[Episode], adv: Sequence[float]):
        from rl.algos import aggregation_weights
        from rl.trainer.batch import EpisodeView, collate

        batch = collate(episodes, adv, pad_id=self.pad_token_id, domains=self.domains)
        mask, doms = batch.loss_mask_BT > 0, batch.domain_ids_B
        view = EpisodeView.of(batch)  # an episode's segments weigh as one sequence (rl/trainer/batch.py)
        if view is not None:
            mask, doms = view.to_episodes(mask, False), doms[view.first_E]
        w, _ = aggregation_weights(self.algorithm.aggregation, mask, domain_ids_B=doms,
                                   domain_names=dict(enumerate(batch.domains)))
        return batch.with_(loss_weights_BT=w if view is None else view.to_rows(w))

    @property
    def has_critic(self) -> bool:
        return self.algorithm.advantage == "gae"

    def collate(self, groups: Sequence[RolloutGroup]):
        """The groups' episodes as one padded TrainBatch with the step batch's aggregation weights (and
        the reference logprobs, when the reward penalty already computed them for these episodes)."""
        episodes = [e for g in groups for e in g.episodes]
        batch = self.batch_of(episodes, [0.0] * len(episodes))
        ref = self._ref_cache.pop(tuple(id(e) for e in episodes), None)
        return batch if ref is None else batch.with_(ref_logprobs_BT=ref)

    def values(self, batch):
        """V(s_t) per generated token from the PPO critic; None without one."""
        return self.trainer.values(batch) if self.has_critic else None

    def submit(self, batch, groups: Sequence[RolloutGroup]) -> PendingUpdate:
        """Start one update of `batch` (the `groups`' episodes, advantages set) on the trainer (non-blocking)."""
        episodes = [e for g in groups for e in g.episodes]
        # The version this update starts from, tracked here: asking the trainer would wait behind the
        # updates queued on it. Lag = that version minus the oldest policy that generated an episode.
        if self._next_update_version is None:
            self._next_update_version = self.trainer.version()
        staleness = self._next_update_version - min(e.policy_version for e in episodes)
        self._next_update_version += 1
        return PendingUpdate(self.trainer, self.trainer.submit_rl_step(batch), staleness)

    def refresh_versions(self) -> int:
        """The trainer's version, re-read after it stepped outside the RL loop (SFT); nothing may be in flight."""
        self._next_update_version = None
        return self.trainer.version()

    def sft_step(self, batch) -> SftStepResult:
        return self.trainer.sft_step(batch)

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)

    def save_checkpoint(self, ckpt_dir: str, client_state: dict | None = None) -> None:
        self.trainer.save_checkpoint(ckpt_dir, client_state)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self.trainer.load_checkpoint(ckpt_dir)

    # ------------------------------------------------------------------ KL reference
    @property
    def uses_reference(self) -> bool:
        a = self.algorithm
        return a.kl_coef > 0 or a.kl_in_reward

    def prepare_reference(self, policy_version: int) -> None:
        """Load the KL reference on the trainer: a named checkpoint, or (`model.reference: initial`) the
        policy as RL starts (at `policy_version`), saved once under the run dir so a resumed run keeps the
        same reference."""
        if not self.uses_reference:
            return
        ref = self.reference
        if ref == "initial" and self.lora is not None:
            # LoRA: the policy as RL starts is the base with its adapters off while they are at their zero init
            # (no SFT step moved them); that reference costs no memory. The marker keeps the choice on resume.
            marker = self.run_dir / "reference" / ".complete"
            if not marker.exists() and policy_version == 0:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps({"policy_version": 0, "base_with_adapters_off": True}))
            if marker.exists() and json.loads(marker.read_text()).get("base_with_adapters_off"):
                self.trainer.use_base_reference()
                log.info("KL reference: the base model with the LoRA adapters switched off")
                return
        if ref == "initial":
            d = self.run_dir / "reference"
            if not (d / ".complete").exists():
                shutil.rmtree(d, ignore_errors=True)
                self.trainer.save_hf(str(d))
                (d / ".complete").write_text(json.dumps({"policy_version": policy_version}))
            ref = str(d)
        self.trainer.load_reference(ref)
        log.info("KL reference loaded from %s", ref)

    def penalise_kl(self, groups: Sequence[RolloutGroup]) -> tuple[list[RolloutGroup], dict[str, float]]:
        """kl_in_reward: each episode's reward minus kl_coef x its summed per-token k1 KL between the
        sampling policy (the engine's logprobs) and the reference (InstructGPT-style penalty, summed
        because the advantage estimators here take one outcome per episode)."""
        from rl.algos.kl import kl_reward_penalty
        from rl.trainer.batch import EpisodeView

        episodes = [e for g in groups for e in g.episodes]
        batch = self.batch_of(episodes, [0.0] * len(episodes))
        ref_BT = self.trainer.reference_logprobs(batch)
        penalty_BT, m = kl_reward_penalty(batch.rollout_logprobs_BT, ref_BT, batch.loss_mask_BT > 0,
                                          coef=self.algorithm.kl_coef, estimator="k1")
        view = EpisodeView.of(batch)  # one penalty per episode, summed over its segments
        pen_B = (penalty_BT if view is None else view.to_episodes(penalty_BT)).sum(dim=1).tolist()
        it = iter(pen_B)
        out = [replace(g, episodes=tuple(replace(e, reward=e.reward + next(it)) for e in g.episodes)) for g in groups]
        new_eps = [e for g in out for e in g.episodes]
        self._ref_cache = {tuple(id(e) for e in new_eps): ref_BT}  # the update reuses this pass
        return out, m
