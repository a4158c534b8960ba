"""Builds and owns the collaborators of a training run; the driver loop (rl/train.py) calls them.

`Runtime.start(cfg)` sets caches, creates the initial checkpoint (a shipped model shape with
fresh weights + the shipped tokenizer) or resumes from the run's last checkpoint, starts Ray
(in-process, or joins RAY_ADDRESS on a cluster), the DeepSpeed trainer actor, the vLLM rollout
workers behind a dispatcher, the environments' task pools and the metrics sink. Each method below
is one verb of the driver loop. Nothing here is RL math.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from jointrl.records import Task
from rl.config import NODE_RESOURCE_UNIT, ConfigError, ModelSection, RunConfig, to_dict
from rl.log import get_logger
from rl.observe.sink import MetricsSink, layout_of
from rl.types import Episode, RolloutGroup

log = get_logger("runtime")


def build_initial_checkpoint(arch: str, out_dir: Path, seed: int) -> Path:
    """A shipped model shape with fresh weights, or a HF checkpoint dir copied as is, in `out_dir`;
    either way with a tokenizer: the checkpoint's own, or the shipped one where it has none (a
    checkpoint's tokenizer is never mixed with shipped files)."""
    from model.shipped import build_random_checkpoint, copy_tokenizer

    out_dir = Path(out_dir)
    src = Path(arch)
    if not (src.is_dir() and (src / "config.json").exists()):
        return build_random_checkpoint(arch, out_dir, seed)
    if not (out_dir / "config.json").exists():
        shutil.copytree(src, out_dir, dirs_exist_ok=True)
    if any((out_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return out_dir
    return copy_tokenizer(out_dir)


def build_codec(model: ModelSection, checkpoint_dir: Path):
    """The run's chat codec (rl/rollout/codec) for the checkpoint it starts from: `model.chat_codec`
    ("auto" follows the checkpoint), with `model.tool_parser` / `model.reasoning_parser` for hf."""
    from rl.rollout.codec import make_codec, resolve_codec_name

    name = resolve_codec_name(model.chat_codec, str(checkpoint_dir))
    codec = make_codec(name, checkpoint_dir, tool_parser=model.tool_parser, reasoning_parser=model.reasoning_parser)
    log.info("chat codec: %s (model.chat_codec=%s)%s", name, model.chat_codec,
             f", tool parser {model.tool_parser!r}, reasoning parser {model.reasoning_parser or 'none'!r}" if name == "hf" else "")
    return codec


ROLLOUT_CPUS = 1  # Ray resources of each rollout worker actor


def engine_config_for(cfg: RunConfig, serve_dir: Path, codec: Any):
    """The rollout engine's EngineConfig for a run serving `serve_dir` through `codec` (LoRA aside)."""
    from rl.rollout.engine import EngineConfig

    ecfg = EngineConfig.from_rollout_section(cfg.rollout, str(serve_dir), seed=cfg.model.seed,
                                             weight_transfer="nccl" if cfg.trainer.sync_transport == "nccl" else None)
    # Thinking budgets need the format's one-token reasoning markers; a format without them gets none.
    markers = codec.reasoning_markers
    return dataclasses.replace(ecfg, reasoning_start=markers[0] if markers else None, reasoning_end=markers[1] if markers else None)


def loop_settings_for(cfg: RunConfig, codec: Any, images: Any = None, temperature: float | None = None):
    """The agent loop's LoopSettings for a run (`temperature` None: rollout.temperature; `images`: an
    ImageSettings, None for text only)."""
    from rl.rollout.agent_loop import LoopSettings
    from rl.rollout.context import ContextSettings
    from rl.rollout.multimodal import ImageSettings

    r = cfg.rollout
    context = ContextSettings(strategy=r.context, budget_tokens=r.context_budget_tokens, keep_turns=r.context_keep_turns,
                              by_domain=dict(r.context_domains))
    return LoopSettings(max_model_len=r.max_model_len, max_new_tokens_per_turn=r.max_new_tokens_per_turn,
                        temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                        thinking_budgets=dict(r.thinking_budgets), max_turns=cfg.envs.max_turns,
                        end_token_id=codec.end_token_id, per_request_seed=r.seeded_requests,
                        images=ImageSettings() if images is None else images, context=context)


def start_local_ray(log_to_driver: bool = True) -> None:
    """A private Ray instance on this machine, as a run without RAY_ADDRESS starts it.

    Ray's raylet starts workers at niceness 15, while sandboxes and graders run at 0: on a busy
    machine the trainer and engines would get the leftovers. A run's actors are its main work, so
    they run at 0 (an explicit RAY_worker_niceness wins).
    """
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 2), include_dashboard=False, log_to_driver=log_to_driver,
             _temp_dir=os.environ.get("RAY_TMPDIR"))


def describe_placement(cfg: RunConfig) -> list[str]:
    """One line per role of the run and where it is placed (what `jointrl train --dry-run` prints)."""
    ray_at = os.environ.get("RAY_ADDRESS") or "a local Ray instance started by the run"
    t = cfg.trainer
    lines = [f"ray: {ray_at}",
             f"trainer: {t.num_workers} DeepSpeed rank(s) (ZeRO-{t.zero_stage}, {cfg.model.dtype}, "
             f"{'NCCL' if t.gpus_per_rank else 'gloo'}), one placement-group bundle each "
             f"{{CPU: {t.cpus_per_rank}{f', GPU: {t.gpus_per_rank}' if t.gpus_per_rank else ''}"
             f"{f', {t.node_resource}: {NODE_RESOURCE_UNIT}' if t.node_resource else ''}}}, packed; "
             "rank 0 hosts the rendezvous and publishes weights"]
    a = cfg.algorithm
    if a.kl_coef > 0 or a.kl_in_reward:
        lines.append(f"reference: frozen {cfg.model.reference!r} policy inside each trainer rank's process")
    r = cfg.rollout.node_resource
    lines.append(f"rollout: {cfg.rollout.num_workers} vLLM worker(s), num_cpus={ROLLOUT_CPUS}"
                 f"{f', {r}={NODE_RESOURCE_UNIT}' if r else ''} each, behind the "
                 f"driver's dispatcher; {_rollout_gpus(cfg)}weight sync {_sync_route(cfg.trainer.sync_transport)}")
    lines.append(f"environments: sandboxes run by the driver's agent loop, up to {cfg.rollout.max_concurrent_episodes} episodes at once")
    return lines


def check_node_resources(cfg: RunConfig, with_trainer: bool = True) -> None:
    """A `*.node_resource` that no node of the Ray cluster offers: refused on the run's own local Ray
    instance (it never will); on a cluster (RAY_ADDRESS) a warning, and the role waits for such a node,
    as the autoscaler may start one or an operator re-add one after a node loss."""
    import ray

    offered = ray.cluster_resources()
    wanted = [("trainer.node_resource", cfg.trainer.node_resource)] if with_trainer else []
    for key, name in wanted + [("rollout.node_resource", cfg.rollout.node_resource)]:
        if not name or offered.get(name, 0.0) >= NODE_RESOURCE_UNIT:
            continue
        custom = sorted(k for k in offered if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:"))
        msg = (f"config key '{key}': no node of the Ray cluster offers resource {name!r} (custom resources offered: "
               f"{', '.join(custom) or 'none'})")
        if not os.environ.get("RAY_ADDRESS"):
            raise ConfigError(f"{msg}; the run's local Ray instance has none: set it only on a cluster (RAY_ADDRESS)")
        log.warning("%s; its %s wait until a node started with `ray start --resources '{\"%s\": 1}'` joins", msg,
                    "ranks" if key.startswith("trainer") else "workers", name)


def _rollout_gpus(cfg: RunConfig) -> str:
    """The rollout workers' GPUs and tensor parallelism, and whether they share the trainer's GPUs ("" on CPU)."""
    r, t = cfg.rollout, cfg.trainer
    if not r.gpus_per_worker:
        return ""
    tp = f" (tensor_parallel_size={r.tensor_parallel_size})" if r.tensor_parallel_size > 1 else ""
    whole = all(g >= 1 and float(g).is_integer() for g in (r.gpus_per_worker, t.gpus_per_rank))
    if whole:
        apart = (f"apart from the trainer's ({r.num_workers} x {r.gpus_per_worker:g} + {t.num_workers} x {t.gpus_per_rank:g} "
                 "whole GPUs)")
    elif t.gpus_per_rank:
        apart = f"possibly sharing a GPU with the trainer (fractional: {t.gpus_per_rank:g} per trainer rank)"
    else:
        apart = "trainer on CPU"
    return f"GPUs: {r.gpus_per_worker:g} per worker{tp}, {apart}; "


def _sync_route(transport: str) -> str:
    return {"shm": "via /dev/shm (forced)", "object_store": "via Ray's object store (forced)",
            "nccl": "over NCCL: trainer rank 0 broadcasts into every worker's GPUs (rl/rollout/nccl_sync.py)"}.get(
        transport, "via /dev/shm when on the trainer's node, else the object store")


def check_gpu_resources(cfg: RunConfig, with_trainer: bool = True) -> None:
    """Refuse at start-up the GPUs a local Ray instance does not have (its actors would wait forever);
    on a cluster (RAY_ADDRESS) only warn, the autoscaler may add them."""
    import ray

    r, t = cfg.rollout, cfg.trainer
    need = r.num_workers * r.gpus_per_worker + (t.num_workers * t.gpus_per_rank if with_trainer else 0.0)
    if need == 0:
        return
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if need <= have:
        return
    msg = (f"the run asks Ray for {need:g} GPU(s) (trainer.gpus_per_rank={t.gpus_per_rank:g} x trainer.num_workers={t.num_workers}"
           f" + rollout.gpus_per_worker={r.gpus_per_worker:g} x rollout.num_workers={r.num_workers}) but Ray sees {have:g}")
    if os.environ.get("RAY_ADDRESS"):
        log.warning("%s; the actors wait until the cluster has them", msg)
        return
    raise ConfigError(f"{msg}: no CUDA device here? Set them to 0 (and trainer.sync_transport != nccl) on CPU "
                      "(docs/training.md, GPU paths)")


@dataclass(frozen=True)
class PendingUpdate:
    """One update running (or queued) on the trainer ranks; `finish()` waits for it."""

    trainer: Any  # rl.trainer.group.TrainerGroup
    refs: list[Any]  # one Ray object ref per rank
    staleness: int  # policy versions between the oldest episode's generator and the weights it trains

    def finish(self) -> dict[str, float]:
        m = self.trainer.wait(self.refs)  # per-rank metrics combined; carries trainer/world_size
        m["policy/staleness"] = float(self.staleness)
        m["rollout/max_staleness_seen"] = float(self.staleness)
        return m


class Runtime:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.resolved_run_dir()
        self.ckpt_dir = self.run_dir / "checkpoint"
        self.start_step = 0
        self.policy_version = 0
        self.rl_seconds = 0.0  # wall time of the RL steps done so far (kept in checkpoints)
        self._actors: list[Any] = []
        self._ref_cache: dict[tuple[int, ...], Any] = {}
        self._next_update_version: int | None = None  # read from the trainer when nothing is in flight

    # ------------------------------------------------------------------ start / stop
    @classmethod
    def start(cls, cfg: RunConfig, *, with_trainer: bool = True) -> "Runtime":
        """Everything a training run needs; `with_trainer=False` for evaluation (engines + envs only)."""
        from rl.paths import setup_cache_env

        setup_cache_env(cfg.resolved_cache_dir())
        rt = cls(cfg)
        rt._start(with_trainer)
        return rt

    def _start(self, with_trainer: bool = True) -> None:
        import ray

        import envs
        from rl.sampler import DomainSampler

        cfg = self.cfg
        random.seed(cfg.envs.seed)
        np.random.seed(cfg.envs.seed)
        torch.manual_seed(cfg.model.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        from rl.rundir import write_config

        write_config(self.run_dir, to_dict(cfg))  # config.json + config.sha256: what `jointrl train` resumes against
        resume = with_trainer and cfg.trainer.resume and (self.ckpt_dir / "meta.json").exists()
        from rl.log import StartupStages

        stages = StartupStages(["initial checkpoint", "task pools", "Ray", "trainer", "rollout engines"],
                               key=f"{cfg.model.arch}|{with_trainer}|{cfg.rollout.num_workers}|{cfg.trainer.num_workers}")
        stages.next("initial checkpoint")
        init_dir = build_initial_checkpoint(cfg.model.arch, self.run_dir / "init_model", cfg.model.seed)
        self.lora = self._plan_lora(init_dir)
        self._check_prefix_sharing(init_dir)
        # LoRA never changes the base weights: engines start from them and receive the adapter (or the merged tensors)
        serve_dir = self.ckpt_dir / "hf" if resume and self.lora is None else init_dir
        self.codec = build_codec(cfg.model, init_dir)
        self.tok = self.codec.tokenizer
        from rl.rollout.codec import reasoning_token_ids

        self.think_ids = reasoning_token_ids(self.codec)  # None: the format has no thinking block to count
        self.image_settings = self._image_settings(init_dir)

        # Task pools: train split for RL/SFT, held-out split for evaluation. Each task is labelled with the
        # run's domain key (`envs.weights`), so a curriculum rung and its full domain (e.g. terminal-basics-v0
        # and terminal-v0, both "terminal" in their env) are sampled, logged and evaluated apart.
        stages.next("task pools")
        envs.load_plugins(cfg.envs.plugins)  # loaded by the config's validation already; a config built in code too
        self.domains = [d for d, w in cfg.envs.weights.items() if w > 0]
        self.env_ids = {d: cfg.envs.env_ids[d] for d in self.domains}
        self.train_tasks: dict[str, list[Task]] = {}
        self.eval_tasks: dict[str, list[Task]] = {}
        for d in self.domains:
            tier = cfg.envs.default_tier.get(d, "high")
            ds_train = envs.tasks(self.env_ids[d], "train", seed=cfg.envs.seed)
            ds_eval = envs.tasks(self.env_ids[d], "heldout", seed=cfg.envs.seed)
            self.train_tasks[d] = [self._with_defaults(Task.from_row(r), tier, d) for r in ds_train]
            self.eval_tasks[d] = [self._with_defaults(Task.from_row(r), tier, d) for r in ds_eval]
        self._check_sandboxes()  # a domain whose sandbox cannot start here is refused now, saying what to change
        if with_trainer and cfg.trainer.sft_data:
            from rl.sft import run_demonstrations

            self.sft_demonstrations = run_demonstrations(self)  # a bad file fails here, before Ray or the trainer start
        self.sampler = DomainSampler(self.train_tasks, dict(cfg.envs.weights), seed=cfg.envs.seed,
                                     adaptive=cfg.envs.adaptive_weights, min_weight=cfg.envs.min_weight)

        # Ray: in-process here, the cluster's when RAY_ADDRESS is set (ray job submit).
        stages.next("Ray")
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address="auto")
            else:
                from rl.admission import admit

                admit(cfg, self.run_dir)  # refused here, before Ray, if it does not fit beside the runs already here
                start_local_ray(log_to_driver=True)
        check_node_resources(cfg, with_trainer)
        check_gpu_resources(cfg, with_trainer)
        if with_trainer:
            stages.next("trainer")
            self._start_trainer(init_dir, resume)
        stages.next("rollout engines")
        self._start_rollout(serve_dir)
        stages.done()
        self.sink = MetricsSink(self.run_dir, wandb_mode=cfg.logging.wandb_mode, project=cfg.logging.wandb_project,
                                run_name=cfg.name, config=to_dict(cfg), layout=layout_of(cfg.logging))
        if resume:
            self._resume()
            # The engine started from the checkpoint's full-precision export; an uninterrupted run's
            # engine holds what the last sync sent (bf16 / MXFP4 differ), so send it the same way.
            self.sync_weights()

    def _with_defaults(self, t: Task, tier: str, domain: str) -> Task:
        from dataclasses import replace

        limits = replace(t.limits, max_turns=min(t.limits.max_turns, self.cfg.envs.max_turns))
        return replace(t, domain=domain, limits=limits, thinking=t.thinking if t.thinking in ("low", "high", "max") else tier)

    def _start_trainer(self, init_dir: Path, resume: bool) -> None:
        from rl.objective import RLObjective
        from rl.trainer.critic import CriticSpec
        from rl.trainer.group import TrainerGroup, TrainerResources
        from rl.trainer.policy import TrainerSpec

        cfg = self.cfg
        a = cfg.algorithm
        self.objective = RLObjective(policy_loss=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high,
                                     tis_cap=a.tis_cap, kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator,
                                     router_aux_coef=cfg.model.router_aux_loss_coef, router_z_coef=cfg.model.router_z_loss_coef)
        spec = TrainerSpec(zero_stage=cfg.trainer.zero_stage, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay,
                           grad_clip=cfg.trainer.grad_clip, warmup_steps=cfg.trainer.warmup_steps,
                           micro_batch_size=cfg.trainer.micro_batch_size, dtype=cfg.model.dtype, seed=cfg.model.seed,
                           routing_replay=cfg.model.routing_replay, freeze_router_bias=cfg.model.freeze_router_bias,
                           frozen_layers=cfg.trainer.frozen_layers, prefix_sharing=cfg.trainer.prefix_sharing,
                           logprob_tile_tokens=cfg.trainer.logprob_tile_tokens,
                           activation_checkpointing=cfg.trainer.activation_checkpointing,
                           max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch, **({"lora": self.lora.spec} if self.lora is not None else {}))
        cache_env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_", "WANDB_"))}
        cache_env["JOINTRL_TRAINER_THREADS"] = str(cfg.trainer.threads_per_rank)  # read by rl/trainer/actor.py
        t = cfg.trainer
        critic = CriticSpec(lr=t.critic_lr, value_clip=a.value_clip, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                            zero_stage=t.zero_stage, micro_batch_size=t.micro_batch_size, dtype=cfg.model.dtype,
                            prefix_sharing=t.prefix_sharing, activation_checkpointing=t.activation_checkpointing,
                            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch) \
            if self.has_critic else None
        self.trainer = TrainerGroup.start(str(init_dir), spec, self.objective, num_ranks=t.num_workers,
                                          resources=TrainerResources(num_cpus=t.cpus_per_rank, num_gpus=t.gpus_per_rank,
                                                                     node_resource=t.node_resource),
                                          env=cache_env, critic=critic)
        info = self.trainer.ready()
        log.info("trainer ready: %s", info)

    def _start_rollout(self, serve_dir: Path) -> None:
        from rl.rollout.dispatcher import RolloutDispatcher
        from rl.rollout.worker import rollout_worker_actor

        cfg = self.cfg
        ecfg = engine_config_for(cfg, serve_dir, self.codec)
        if self.lora is not None and self.lora.spec.sync == "adapter":
            from dataclasses import replace

            ecfg = replace(ecfg, lora_rank=self.lora.spec.rank, lora_targets=self.lora.vllm_targets)
        env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "VLLM_", "HF_", "TRANSFORMERS_", "TORCH_", "XDG_"))}
        marker = cfg.rollout.node_resource  # replacements after a worker's node is lost stay on such nodes too
        Actor = rollout_worker_actor(num_cpus=ROLLOUT_CPUS, num_gpus=cfg.rollout.gpus_per_worker,
                                     resources={marker: NODE_RESOURCE_UNIT} if marker else None)
        self.rollout_engine = RolloutDispatcher(lambda: Actor.remote(ecfg, env), cfg.rollout.num_workers)
        log.info("rollout workers ready: %s", self.rollout_engine.health())

    def _check_sandboxes(self) -> None:
        """Make one environment of each domain: a domain that needs a sandbox builds its backend then, which raises
        `SandboxUnavailable` (with what to change, e.g. no root and no user namespaces) before anything starts."""
        from envs.sandbox.base import SandboxUnavailable

        for d in self.domains:
            try:
                env = self.make_env(self.train_tasks[d][0]) if self.train_tasks[d] else None
            except SandboxUnavailable as e:
                raise ConfigError(f"domain {d!r} ({self.env_ids[d]}) needs a sandbox, and none can start here: {e}") from None
            if env is not None:
                env.close()

    def _check_prefix_sharing(self, init_dir: Path) -> None:
        """trainer.prefix_sharing='on' with a model whose attention cannot take a tree mask: a ConfigError
        before Ray starts ('auto' then runs padded; rl/trainer/packing.py)."""
        if self.cfg.trainer.prefix_sharing != "on":
            return
        from transformers import AutoConfig

        from model.families import packing_refusal

        import model  # noqa: F401  (registers hybrid_moe with AutoConfig)

        why = packing_refusal(AutoConfig.from_pretrained(str(init_dir)))
        if why:
            raise ConfigError(f"config key 'trainer.prefix_sharing': 'on' but {why}; allowed values: 'auto', 'off' for this model")

    def _plan_lora(self, init_dir: Path):
        """The run's LoRA plan (rl/trainer/lora.py), or None without LoRA; says once which sync path runs and why."""
        lora = self.cfg.trainer.lora
        if lora.rank == 0:
            return None
        from rl.trainer.lora import LoraSpec, plan_lora

        spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets), sync=lora.sync)
        try:
            plan = plan_lora(str(init_dir), spec, engine_on_cpu=self.cfg.rollout.gpus_per_worker == 0)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        log.info("LoRA rank %d on %s: weight sync sends %s (%s)", spec.rank, list(spec.targets),
                 "the adapter alone (vLLM LoRA requests)" if plan.spec.sync == "adapter" else "merged weights (adapted tensors only)",
                 plan.reason)
        return plan

    def shutdown(self) -> None:
        import ray

        if getattr(self, "_partial", None) is not None:
            self._partial.close()  # paused episodes' environments (sandboxes)
        try:
            self.sink.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.rollout_engine.shutdown()
        except Exception:  # noqa: BLE001
            pass
        if getattr(self, "trainer", None) is not None:
            try:  # remove the /dev/shm sync area now (its reaper would, moments after the actor dies)
                self.trainer.close_sync()
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "trainer", None) is not None:
            self.trainer.kill()
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        if not os.environ.get("RAY_ADDRESS") and ray.is_initialized():
            ray.shutdown()
        from rl.admission import release

        release()

    # ------------------------------------------------------------------ rollout
    def make_env(self, task: Task):
        import envs

        env = envs.make(self.env_ids[task.domain])
        # A policy that takes images gets the task's pictures in its prompt where the env offers them (cad-v0's
        # target views); text-only runs keep text-only prompts (their codecs and SFT data take no images).
        if self.cfg.rollout.max_images_per_prompt and hasattr(env, "prompt_views"):
            env.prompt_views = True
        return env

    def _image_settings(self, model_dir: Path):
        """What images reach the policy (rollout.max_images_per_prompt / image_pixels); refused up front for a
        checkpoint without a vision tower."""
        from transformers import AutoConfig

        import model  # noqa: F401 - registers HybridMoe with AutoConfig
        from model.vision import VisionSpec
        from rl.rollout.multimodal import ImageSettings

        r = self.cfg.rollout
        spec = VisionSpec.from_config(AutoConfig.from_pretrained(str(model_dir)))
        if r.max_images_per_prompt and spec is None:
            raise ConfigError(f"config key 'rollout.max_images_per_prompt': {r.max_images_per_prompt} images per episode, but "
                              f"{self.cfg.model.arch!r} has no vision tower (image input is HybridMoe's only); set it to 0")
        return ImageSettings(spec=spec, max_images=r.max_images_per_prompt, pixels=r.image_pixels)

    def _loop_settings(self, temperature: float | None = None):
        return loop_settings_for(self.cfg, self.codec, self.image_settings, temperature)

    def run_groups(self, tasks: Sequence[Task], group_size: int, temperature: float | None = None, seed: int = 0) -> list[list[Episode]]:
        from rl.rollout.agent_loop import BatchingGenerator, ThreadedGenerate, run_groups

        async def go():
            # The dispatcher blocks on Ray: each batch waits in a thread of its own, so every waiting episode's
            # request reaches the continuously batching engine at once.
            max_concurrent = self.cfg.rollout.max_concurrent_episodes
            async with ThreadedGenerate(self.rollout_engine.generate, max_concurrent) as generate_batch:
                gen = BatchingGenerator(generate_batch)
                return await run_groups(tasks, group_size, self.make_env, gen, self.tok, self.codec, self._loop_settings(temperature),
                                        policy_version=self.policy_version, max_concurrent=max_concurrent, seed=seed)

        return asyncio.run(go())

    def run_partial(self, tasks: Sequence[Task], group_size: int, seed: int = 0):
        """One step of partial rollouts: ([(task, episodes)] of the groups that finished, metrics); the episodes
        still running when rollout.step_token_budget is spent continue in the next call."""
        from rl.rollout.agent_loop import BatchingGenerator, ThreadedGenerate
        from rl.rollout.partial import PartialRollouts

        if getattr(self, "_partial", None) is None:
            self._partial = PartialRollouts(self.cfg.rollout.step_token_budget)

        async def go():
            max_concurrent = self.cfg.rollout.max_concurrent_episodes
            async with ThreadedGenerate(self.rollout_engine.generate, max_concurrent) as generate_batch:
                return await self._partial.step(tasks, group_size, self.make_env, BatchingGenerator(generate_batch), self.tok,
                                                self.codec, self._loop_settings(), policy_version=self.policy_version,
                                                max_concurrent=max_concurrent, seed=seed)

        out = asyncio.run(go())
        return out.groups, out.metrics

    def rollout(self, tasks: Sequence[Task], step: int, draw: int = 0) -> tuple[list[RolloutGroup], dict[str, float]]:
        """G episodes per task. Sampling seeds depend on (run seed, step, draw, task, sample, turn) only,
        so a run resumed at `step` replays what an uninterrupted run would (docs/rollout.md,
        Determinism); `draw` numbers the extra rollouts of one step (oversampling)."""
        from rl.rollout.agent_loop import derive_seed, rollout_seed

        from rl.observe.telemetry import rollout_metrics

        t0 = time.perf_counter()
        G = self.cfg.algorithm.group_size
        seed = rollout_seed(self.cfg.envs.seed, step)
        partial_m: dict[str, float] = {}
        if self.cfg.rollout.partial == "on":  # a step bounded by rollout.step_token_budget (rl/rollout/partial.py)
            done, partial_m = self.run_partial(tasks, G, seed=seed if draw == 0 else derive_seed(seed, draw))
            tasks, eps = [t for t, _ in done], [e for _, e in done]  # the groups that finished, carried-over ones first
        else:
            eps = self.run_groups(tasks, G, seed=seed if draw == 0 else derive_seed(seed, draw))
        groups = [RolloutGroup(task_id=t.id, domain=t.domain, episodes=tuple(e)) for t, e in zip(tasks, eps)]
        m = rollout_metrics(groups, self.think_ids, policy_version=self.policy_version)
        m.update(partial_m)
        m["rollout/episodes_per_s"] = sum(len(g.episodes) for g in groups) / max(time.perf_counter() - t0, 1e-9)
        return groups, m

    # ------------------------------------------------------------------ training
    def batch_of(self, episodes: Sequence[Episode], adv: Sequence[float]):
        from rl.algos import aggregation_weights
        from rl.trainer.batch import EpisodeView, collate

        batch = collate(episodes, adv, pad_id=self.codec.pad_token_id, domains=self.domains)
        mask, doms = batch.loss_mask_BT > 0, batch.domain_ids_B
        view = EpisodeView.of(batch)  # an episode's segments weigh as one sequence (rl/trainer/batch.py)
        if view is not None:
            mask, doms = view.to_episodes(mask, False), doms[view.first_E]
        w, _ = aggregation_weights(self.cfg.algorithm.aggregation, mask, domain_ids_B=doms,
                                   domain_names=dict(enumerate(batch.domains)))
        return batch.with_(loss_weights_BT=w if view is None else view.to_rows(w))

    @property
    def has_critic(self) -> bool:
        return self.cfg.algorithm.advantage == "gae"

    def collate(self, groups: Sequence[RolloutGroup]):
        """The groups' episodes as one padded TrainBatch with the step batch's aggregation weights (and
        the reference logprobs, when the reward penalty already computed them for these episodes)."""
        episodes = [e for g in groups for e in g.episodes]
        batch = self.batch_of(episodes, [0.0] * len(episodes))
        ref = self._ref_cache.pop(tuple(id(e) for e in episodes), None)
        return batch if ref is None else batch.with_(ref_logprobs_BT=ref)

    def submit_train(self, batch, groups: Sequence[RolloutGroup]) -> Any:
        """Start one update of `batch` (the `groups`' episodes, advantages set) on the trainer;
        returns a `PendingUpdate` (non-blocking)."""
        episodes = [e for g in groups for e in g.episodes]
        # The version this update starts from, tracked here: asking the trainer would wait behind the
        # updates queued on it. Lag = that version minus the oldest policy that generated an episode.
        if self._next_update_version is None:
            self._next_update_version = self.trainer.version()
        staleness = self._next_update_version - min(e.policy_version for e in episodes)
        self._next_update_version += 1
        return PendingUpdate(self.trainer, self.trainer.submit_rl_step(batch), staleness)

    # ------------------------------------------------------------------ KL reference
    @property
    def uses_reference(self) -> bool:
        a = self.cfg.algorithm
        return a.kl_coef > 0 or a.kl_in_reward

    def prepare_reference(self) -> None:
        """Load the KL reference on the trainer: a named checkpoint, or (`model.reference: initial`) the
        policy as RL starts, saved once under the run dir so a resumed run keeps the same reference."""
        if not self.uses_reference:
            return
        ref = self.cfg.model.reference
        if ref == "initial" and self.lora is not None:
            # LoRA: the policy as RL starts is the base with its adapters off while they are at their zero init
            # (no SFT step moved them); that reference costs no memory. The marker keeps the choice on resume.
            marker = self.run_dir / "reference" / ".complete"
            if not marker.exists() and self.policy_version == 0:
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
                (d / ".complete").write_text(json.dumps({"policy_version": self.policy_version}))
            ref = str(d)
        self.trainer.load_reference(ref)
        log.info("KL reference loaded from %s", ref)

    def penalise_kl(self, groups: Sequence[RolloutGroup]) -> tuple[list[RolloutGroup], dict[str, float]]:
        """kl_in_reward: each episode's reward minus kl_coef x its summed per-token k1 KL between the
        sampling policy (the engine's logprobs) and the reference (InstructGPT-style penalty, summed
        because the advantage estimators here take one outcome per episode)."""
        from dataclasses import replace

        from rl.algos.kl import kl_reward_penalty

        episodes = [e for g in groups for e in g.episodes]
        batch = self.batch_of(episodes, [0.0] * len(episodes))
        ref_BT = self.trainer.reference_logprobs(batch)
        penalty_BT, m = kl_reward_penalty(batch.rollout_logprobs_BT, ref_BT, batch.loss_mask_BT > 0,
                                          coef=self.cfg.algorithm.kl_coef, estimator="k1")
        from rl.trainer.batch import EpisodeView

        view = EpisodeView.of(batch)  # one penalty per episode, summed over its segments
        pen_B = (penalty_BT if view is None else view.to_episodes(penalty_BT)).sum(dim=1).tolist()
        it = iter(pen_B)
        out = [replace(g, episodes=tuple(replace(e, reward=e.reward + next(it)) for e in g.episodes)) for g in groups]
        new_eps = [e for g in out for e in g.episodes]
        self._ref_cache = {tuple(id(e) for e in new_eps): ref_BT}  # the update reuses this pass
        return out, m

    def refresh_versions(self) -> None:
        """Re-read the trainer's version after it stepped outside the RL loop (SFT); nothing may be in flight."""
        self.policy_version = self.trainer.version()
        self._next_update_version = None

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> rollout engines, never through the driver's memory.

        Same-node workers read the trainer's /dev/shm area (only a small index crosses Ray); otherwise
        the buckets go through Ray's object store (rl/weights/, "same-node transport").
        $JOINTRL_SYNC_TRANSPORT=shm|object_store forces one.
        """
        from rl.weights import ShmBucket, requested_transport

        t0 = time.perf_counter()
        version = self.trainer.version()
        if self.cfg.trainer.sync_transport == "nccl":  # GPU only: rank 0 broadcasts into the workers (rl/rollout/nccl_sync.py)
            from rl.rollout.nccl_sync import NcclWeightSync

            if getattr(self, "_nccl", None) is None:
                self._nccl = NcclWeightSync.setup(self.trainer, self.rollout_engine, self.cfg)
            m = self._nccl.sync(version)
            self.policy_version = version
            return m
        transport = requested_transport(self.cfg.trainer.sync_transport)
        readers = self.rollout_engine.reader_nodes() if transport == "auto" else []
        # Bucket refs (or shm indexes) owned by the trainer: the payload never passes through the driver.
        bucket_refs = self.trainer.export_weights(self.cfg.trainer.sync_bucket_mb, self.cfg.trainer.sync_format,
                                                  transport, readers)
        t_export = time.perf_counter()
        stats = self.rollout_engine.update_weights(bucket_refs, version)
        self.policy_version = version
        dt = time.perf_counter() - t0
        nbytes = float(max((s.num_bytes for s in stats), default=0))
        return {"sync/seconds": dt, "sync/export_s": t_export - t0, "sync/load_s": max((s.seconds for s in stats), default=0.0),
                "sync/bytes": nbytes, "sync/bytes_per_s": nbytes / max(dt, 1e-9), "sync/buckets": float(len(bucket_refs)),
                "sync/shm": float(any(isinstance(b, ShmBucket) for b in bucket_refs)),
                **({"sync/lora_adapter": float(self.lora.spec.sync == "adapter")} if self.lora is not None else {})}

    def measure_gap(self, groups: Sequence[RolloutGroup], n: int = 4) -> dict[str, float]:
        """Engine vs trainer logprobs of the same generated tokens under the same (new) weights."""
        eps = [e for g in groups for e in g.episodes if sum(e.loss_mask) > 0][:n]
        if not eps:
            return {}
        seqs = [list(e.token_ids[: self.cfg.rollout.max_model_len - 1]) for e in eps]
        engine_lp = self.rollout_engine.score(seqs)
        batch = self.batch_of([dataclasses.replace(e, segments=()) for e in eps], [0.0] * len(eps))  # last contexts
        trainer_lp, _ = self.trainer.compute_logprobs(batch)
        diffs = []
        for i, e in enumerate(eps):
            T = len(seqs[i])
            m = np.asarray(e.loss_mask[1:T], dtype=bool)
            d = np.abs(np.asarray(engine_lp[i])[: T - 1] - trainer_lp[i, 1:T].numpy())[m]
            diffs.append(d)
        d = np.concatenate(diffs) if diffs else np.zeros(1)
        return {"mismatch/logprob_abs_mean": float(d.mean()), "mismatch/logprob_abs_max": float(d.max())}

    # ------------------------------------------------------------------ eval, logging, checkpoints
    def samples_for_log(self, groups: Sequence[RolloutGroup]) -> list[dict[str, str]]:
        out = []
        per = self.cfg.logging.samples_per_domain
        for d in self.domains:
            eps = [e for g in groups if g.domain == d for e in g.episodes][:per]
            for e in eps:
                text = self.tok.decode(list(e.token_ids), skip_special_tokens=False)
                out.append({"domain": d, "task_id": e.task_id, "reward": f"{e.reward:.3f}", "turns": str(e.num_turns),
                            "transcript": text[-4000:]})
        return out

    def checkpoint(self, step: int) -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {"sampler": self.sampler.state_dict(), "step": step, "rl_seconds": self.rl_seconds,
                 "py_random": random.getstate(), "np_random": np.random.get_state()}
        self.trainer.save_checkpoint(str(self.ckpt_dir / "ds"), {"driver": state})
        self.trainer.save_hf(str(self.ckpt_dir / "hf"))
        tmp = self.ckpt_dir / "meta.json.tmp"
        tmp.write_text(json.dumps({"step": step, "policy_version": self.policy_version}))
        tmp.replace(self.ckpt_dir / "meta.json")  # atomic: a kill mid-save leaves the previous checkpoint valid
        log.info("checkpoint saved at step %d", step)

    def _resume(self) -> None:
        meta = json.loads((self.ckpt_dir / "meta.json").read_text())
        state = self.trainer.load_checkpoint(str(self.ckpt_dir / "ds"))
        drv = (state or {}).get("driver", {})
        if "sampler" in drv:
            self.sampler.load_state_dict(drv["sampler"])
        if "py_random" in drv:
            random.setstate(drv["py_random"])
        if "np_random" in drv:
            np.random.set_state(drv["np_random"])
        self.rl_seconds = float(drv.get("rl_seconds", 0.0))
        self.start_step = int(meta["step"])
        self.policy_version = int(meta["policy_version"])
        # Said once, in these words, so a log shows how the run came back: a lost trainer (or a
        # stopped job) ends the run, and this is a new `jointrl train` continuing it.
        log.warning("resumed from the last checkpoint (%s: step %d, policy version %d) because `jointrl train` was "
                    "started again on this run (trainer.resume=true); the driver never restarts a lost trainer by itself",
                    self.ckpt_dir, self.start_step, self.policy_version)
