"""Where a run's roles are placed on Ray, and the start-up checks of what the cluster offers.

`describe_placement` is what `jointrl train --dry-run` prints; `check_node_resources` and
`check_gpu_resources` refuse on the run's own local Ray what it will never have (a cluster only warns,
as an autoscaler may add it); `start_local_ray` starts the private Ray instance of a run without
RAY_ADDRESS. Read at start-up (rl/setup.py) only; nothing here starts an actor.
"""
from __future__ import annotations

import os

from rl.config import NODE_RESOURCE_UNIT, RunConfig
from rl.errors import ConfigError
from rl.log import get_logger
from rl.trainer.config import resolve_zero_stage

log = get_logger("setup")


ROLLOUT_CPUS = 1  # Ray resources of each rollout worker actor


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
             f"trainer: {t.num_workers} DeepSpeed rank(s) (ZeRO-{resolve_zero_stage(t.zero_stage, t.num_workers)}, {cfg.model.dtype}, "
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
