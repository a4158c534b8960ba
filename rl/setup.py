"""Start-up: a run's parts built from their config sections, handed to the run's phases and the loop.

`start_run(cfg)` sets the caches, seeds the generators, writes the run's config, builds the initial
checkpoint (a shipped model shape with fresh weights + the shipped tokenizer, or a HF checkpoint as it is),
the chat codec, the task pools and the SFT set, starts Ray (in-process, or joins RAY_ADDRESS on a cluster),
the DeepSpeed trainer ranks, the vLLM rollout workers behind a dispatcher and the metrics sink, and resumes
from the run's last checkpoint when there is one. It returns `RunParts`, a context manager whose exit
shuts them down in order: partial episodes -> sink -> dispatcher -> trainer sync area -> trainer ranks ->
the local Ray instance -> the admission slot. `start_run(cfg, with_trainer=False)` is evaluation only
(engines and environments). This is the one module that reads the whole RunConfig to build the run;
each part gets its own sections. Nothing here is RL math, and nothing here runs a step.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl.checkpoint import Checkpoints, DriverState
from rl.config import NODE_RESOURCE_UNIT, LoraSection, ModelSection, RolloutSection, RunConfig, pull_models, to_dict
from rl.errors import ConfigError
from rl.log import get_logger
from rl.placement import ROLLOUT_CPUS, check_gpu_resources, check_node_resources, start_local_ray

log = get_logger("setup")


@dataclass(frozen=True)
class RunParts:
    """What `start_run` yields: the run's parts, each built from its own config sections."""

    run_dir: Path
    codec: Any  # rl.rollout.codec: the run's chat codec
    pools: Any  # rl.tasks.TaskPools
    sampler: Any  # rl.sampler.DomainSampler over the train pools
    rollouts: Any  # rl.rollout.rollouts.Rollouts
    sink: Any  # rl.observe.sink.MetricsSink
    state: DriverState  # where RL starts: step 0, or the resumed checkpoint's
    policy: Any = None  # rl.trainer.client.PolicyClient; None for evaluation only
    sync: Any = None  # rl.sync.WeightSync; None for evaluation only
    checkpoints: Checkpoints | None = None
    sft: Any = None  # rl.sft.SftSet; None without a trainer

    def __enter__(self) -> "RunParts":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Shut the parts down, the order start-up relies on (each step tolerates the one before failing)."""
        import ray

        self.rollouts.close()  # paused episodes' environments (sandboxes)
        for stop in (self.sink.close, self.rollouts.engine.shutdown):
            try:
                stop()
            except Exception:  # noqa: BLE001
                pass
        if self.policy is not None:
            try:  # remove the /dev/shm sync area now (its reaper would, moments after the actor dies)
                self.policy.trainer.close_sync()
            except Exception:  # noqa: BLE001
                pass
            self.policy.trainer.kill()
        if not os.environ.get("RAY_ADDRESS") and ray.is_initialized():
            ray.shutdown()
        from rl.admission import release

        release()


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


def start_run(cfg: RunConfig, *, with_trainer: bool = True) -> RunParts:
    """Everything a training run needs; `with_trainer=False` for evaluation (engines + envs only). First, before
    anything starts, a pullable `model.arch` / `model.reference` is pulled and its weights checked
    (`pull_models`: a ConfigError naming the key; nothing to do once they are directories)."""
    import ray

    from rl.log import StartupStages
    from rl.observe.sink import MetricsSink, layout_of
    from rl.paths import setup_cache_env
    from rl.rollout.codec import reasoning_token_ids
    from rl.rollout.rollouts import Rollouts
    from rl.rundir import write_config
    from rl.sampler import DomainSampler
    from rl.tasks import TaskPools

    cfg = pull_models(cfg)
    setup_cache_env(cfg.resolved_cache_dir())
    run_dir = cfg.resolved_run_dir()
    random.seed(cfg.envs.seed)
    np.random.seed(cfg.envs.seed)
    torch.manual_seed(cfg.model.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, to_dict(cfg))  # config.json + config.sha256: what `jointrl train` resumes against
    ckpt_dir = run_dir / "checkpoint"
    resume = with_trainer and cfg.trainer.resume and (ckpt_dir / "meta.json").exists()
    stages = StartupStages(["initial checkpoint", "task pools", "Ray", "trainer", "rollout engines"],
                           key=f"{cfg.model.arch}|{with_trainer}|{cfg.rollout.num_workers}|{cfg.trainer.num_workers}")
    stages.next("initial checkpoint")
    init_dir = build_initial_checkpoint(cfg.model.arch, run_dir / "init_model", cfg.model.seed)
    lora = plan_lora(cfg.trainer.lora, init_dir, engine_on_cpu=cfg.rollout.gpus_per_worker == 0)
    check_prefix_sharing(cfg.trainer.prefix_sharing, init_dir)
    # LoRA never changes the base weights: engines start from them and receive the adapter (or the merged tensors)
    serve_dir = ckpt_dir / "hf" if resume and lora is None else init_dir
    codec = build_codec(cfg.model, init_dir)
    images = image_settings(cfg.rollout, cfg.model.arch, init_dir)

    # Task pools: train split for RL/SFT, held-out split for evaluation (rl/tasks.py).
    stages.next("task pools")
    pools = TaskPools.load(cfg.envs, prompt_views=cfg.rollout.max_images_per_prompt > 0)
    pools.check_sandboxes()  # a domain whose sandbox cannot start here is refused now, saying what to change
    sft = None
    if with_trainer:
        from rl.sft import SftSet

        sft = SftSet.load(pools, cfg.trainer, sandbox_slots=cfg.envs.sandbox_slots, max_model_len=cfg.rollout.max_model_len)
    e = cfg.envs
    sampler = DomainSampler(pools.train, dict(e.weights), seed=e.seed, adaptive=e.adaptive_weights, min_weight=e.min_weight)

    # Ray: in-process here, the cluster's when RAY_ADDRESS is set (ray job submit).
    stages.next("Ray")
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address="auto")
        else:
            from rl.admission import admit

            admit(cfg, run_dir)  # refused here, before Ray, if it does not fit beside the runs already here
            start_local_ray(log_to_driver=True)
    check_node_resources(cfg, with_trainer)
    check_gpu_resources(cfg, with_trainer)
    policy = None
    if with_trainer:
        from rl.trainer.client import PolicyClient

        stages.next("trainer")
        trainer = start_trainer(cfg, init_dir, lora)
        policy = PolicyClient(trainer, cfg.algorithm, reference=cfg.model.reference, run_dir=run_dir,
                              pad_token_id=codec.pad_token_id, domains=pools.domains, lora=lora)
    stages.next("rollout engines")
    engine = start_rollout(cfg, serve_dir, codec, lora)
    stages.done()
    r = cfg.rollout
    rollouts = Rollouts(engine, pools.make_env, codec, loop_settings_for(cfg, codec, images), group_size=cfg.algorithm.group_size,
                        seed=cfg.envs.seed, max_concurrent=r.max_concurrent_episodes, partial=r.partial == "on",
                        step_token_budget=r.step_token_budget, step_time_budget_s=r.step_time_budget_s or 0.0,
                        think_ids=reasoning_token_ids(codec))
    sink = MetricsSink(run_dir, wandb_mode=cfg.logging.wandb_mode, project=cfg.logging.wandb_project,
                       run_name=cfg.name, config=to_dict(cfg), layout=layout_of(cfg.logging))
    sync = checkpoints = None
    state = DriverState()
    if policy is not None:
        from rl.sync import WeightSync

        t = cfg.trainer
        sync = WeightSync(policy, rollouts, transport=t.sync_transport, bucket_mb=t.sync_bucket_mb, fmt=t.sync_format,
                          tensor_parallel_size=r.tensor_parallel_size, max_model_len=r.max_model_len,
                          lora_adapter=None if lora is None else lora.spec.sync == "adapter")
        checkpoints = Checkpoints(ckpt_dir, policy)
    if resume:
        state = checkpoints.resume(sampler)
        rollouts.policy_version = state.policy_version
        # The engine started from the checkpoint's full-precision export; an uninterrupted run's
        # engine holds what the last sync sent (bf16 / MXFP4 differ), so send it the same way.
        sync.push()
    return RunParts(run_dir=run_dir, codec=codec, pools=pools, sampler=sampler, rollouts=rollouts, sink=sink, state=state,
                    policy=policy, sync=sync, checkpoints=checkpoints, sft=sft)


def start_trainer(cfg: RunConfig, init_dir: Path, lora: Any) -> Any:
    """The DeepSpeed trainer ranks (rl/trainer/group.py) for the `trainer`, `model` and `algorithm` sections."""
    from rl.objective import RLObjective
    from rl.trainer.critic import CriticSpec
    from rl.trainer.group import TrainerGroup, TrainerResources
    from rl.trainer.policy import TrainerSpec

    a = cfg.algorithm
    m = cfg.model
    t = cfg.trainer
    objective = RLObjective(policy_loss=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high,
                            tis_cap=a.tis_cap, kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator,
                            router_aux_coef=m.router_aux_loss_coef, router_z_coef=m.router_z_loss_coef)
    spec = TrainerSpec(zero_stage=t.zero_stage, lr=t.lr, weight_decay=t.weight_decay,
                       grad_clip=t.grad_clip, warmup_steps=t.warmup_steps,
                       micro_batch_size=t.micro_batch_size, dtype=m.dtype, seed=m.seed,
                       routing_replay=m.routing_replay, freeze_router_bias=m.freeze_router_bias,
                       frozen_layers=t.frozen_layers, prefix_sharing=t.prefix_sharing,
                       logprob_tile_tokens=t.logprob_tile_tokens,
                       activation_checkpointing=t.activation_checkpointing,
                       max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, sequence_parallel_size=t.sequence_parallel_size,
                       **({"lora": lora.spec} if lora is not None else {}))
    cache_env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_", "WANDB_"))}
    cache_env["JOINTRL_TRAINER_THREADS"] = str(t.threads_per_rank)  # read by rl/trainer/actor.py
    critic = CriticSpec(lr=t.critic_lr, value_clip=a.value_clip, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                        zero_stage=t.zero_stage, micro_batch_size=t.micro_batch_size, dtype=m.dtype,
                        prefix_sharing=t.prefix_sharing, activation_checkpointing=t.activation_checkpointing,
                        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch) \
        if a.advantage == "gae" else None
    trainer = TrainerGroup.start(str(init_dir), spec, objective, num_ranks=t.num_workers,
                                 resources=TrainerResources(num_cpus=t.cpus_per_rank, num_gpus=t.gpus_per_rank,
                                                            node_resource=t.node_resource),
                                 env=cache_env, critic=critic)
    log.info("trainer ready: %s", trainer.ready())
    return trainer


def start_rollout(cfg: RunConfig, serve_dir: Path, codec: Any, lora: Any) -> Any:
    """The rollout workers (vLLM engines in Ray actors) behind the driver's dispatcher."""
    from rl.rollout.dispatcher import RolloutDispatcher
    from rl.rollout.worker import rollout_worker_actor

    ecfg = engine_config_for(cfg, serve_dir, codec)
    if lora is not None and lora.spec.sync == "adapter":
        ecfg = dataclasses.replace(ecfg, lora_rank=lora.spec.rank, lora_targets=lora.vllm_targets)
    env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "VLLM_", "HF_", "TRANSFORMERS_", "TORCH_", "XDG_"))}
    marker = cfg.rollout.node_resource  # replacements after a worker's node is lost stay on such nodes too
    Actor = rollout_worker_actor(num_cpus=ROLLOUT_CPUS, num_gpus=cfg.rollout.gpus_per_worker,
                                 resources={marker: NODE_RESOURCE_UNIT} if marker else None)
    engine = RolloutDispatcher(lambda: Actor.remote(ecfg, env), cfg.rollout.num_workers)
    log.info("rollout workers ready: %s", engine.health())
    return engine


def check_prefix_sharing(prefix_sharing: str, init_dir: Path) -> None:
    """trainer.prefix_sharing='on' with a model whose attention cannot take a tree mask: a ConfigError
    before Ray starts ('auto' then runs padded; rl/trainer/packing.py)."""
    if prefix_sharing != "on":
        return
    from transformers import AutoConfig

    from model.families import packing_refusal

    import model  # noqa: F401  (registers hybrid_moe with AutoConfig)

    why = packing_refusal(AutoConfig.from_pretrained(str(init_dir)))
    if why:
        raise ConfigError(f"config key 'trainer.prefix_sharing': 'on' but {why}; allowed values: 'auto', 'off' for this model")


def plan_lora(lora: LoraSection, init_dir: Path, engine_on_cpu: bool):
    """The run's LoRA plan for the `trainer.lora` section (rl/trainer/lora.py), or None without LoRA; says once
    which sync path runs and why."""
    if lora.rank == 0:
        return None
    from rl.trainer.lora import LoraSpec, plan_lora as plan

    spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets), sync=lora.sync)
    try:
        p = plan(str(init_dir), spec, engine_on_cpu=engine_on_cpu)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    log.info("LoRA rank %d on %s: weight sync sends %s (%s)", spec.rank, list(spec.targets),
             "the adapter alone (vLLM LoRA requests)" if p.spec.sync == "adapter" else "merged weights (adapted tensors only)",
             p.reason)
    return p


def image_settings(rollout: RolloutSection, arch: str, model_dir: Path):
    """What images reach the policy (`rollout.max_images_per_prompt` / `image_pixels`); refused up front for a
    checkpoint without a vision tower (`arch`: model.arch, named in the refusal)."""
    from transformers import AutoConfig

    import model  # noqa: F401 - registers HybridMoe with AutoConfig
    from model.vision import VisionSpec
    from rl.rollout.multimodal import ImageSettings

    spec = VisionSpec.from_config(AutoConfig.from_pretrained(str(model_dir)))
    if rollout.max_images_per_prompt and spec is None:
        raise ConfigError(f"config key 'rollout.max_images_per_prompt': {rollout.max_images_per_prompt} images per episode, but "
                          f"{arch!r} has no vision tower (image input is HybridMoe's only); set it to 0")
    return ImageSettings(spec=spec, max_images=rollout.max_images_per_prompt, pixels=rollout.image_pixels)
