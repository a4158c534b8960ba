"""N DeepSpeed ranks as Ray actors in one placement group, driven as one trainer.

`TrainerGroup.start(...)` reserves one bundle per rank (`TrainerResources`: CPUs and GPUs per rank),
starts a `TrainerWorker` in each, and joins them in one torch.distributed group (gloo on CPU, NCCL
on GPU) whose rendezvous is rank 0's node. Each step batch is cut into length-grouped micro-batches and
those are dealt to the ranks by real-token count (`split_micro_batches`); the shards keep the whole
batch's loss weights and totals, so N ranks compute the update one rank would on the same batch (tests/rl/trainer/test_group.py checks it to
1e-5 for ZeRO 1, 2 and 3). Every rank runs the same number of micro-batches (padding ones add
nothing), which ZeRO-3's collective gathers need. Rank 0 publishes weights and HF checkpoints.

A placement the cluster cannot make within `PLACEMENT_TIMEOUT_S` fails with `TrainerPlacementError` naming the
resources asked for and the cluster's (Ray itself would wait forever).

What it does not do: restart a dead rank (a lost rank, or its node, fails the step with
`TrainerLostError`; `jointrl train` again resumes the run from its last checkpoint), shard the KL
reference (each rank holds a frozen copy), or pipeline/tensor parallelism. `TrainerResources.node_resource`
keeps the bundles on the nodes started with that custom resource.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from rl.types import Reduce, SftStepResult, TrainResult
from rl.trainer.batch import MicroBatching, TrainBatch, micro_rows, split_micro_batches

# Metric families the trainer itself reports: each such metric is a field of its record (rl/types.py) declaring
# how ranks combine it; one without a field is refused rather than silently averaged.
_TRAINER_FAMILIES = ("train/", "value/", "sft/", "trainer/")
_ROUTING = "train/routing_replay_"

@dataclass(frozen=True)
class TrainerResources:
    """Ray resources of one trainer rank (one placement-group bundle each)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # A custom Ray resource each bundle also requires ("" = none), so ranks land only on the nodes
    # started with it (`trainer.node_resource`); each takes NODE_RESOURCE_UNIT of it.
    node_resource: str = ""

    def bundle(self) -> dict[str, float]:
        from rl.config import NODE_RESOURCE_UNIT

        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {}),
                **({self.node_resource: NODE_RESOURCE_UNIT} if self.node_resource else {})}


def _combine(rule: Reduce, vals: list[tuple[Any, float]], total: float) -> Any:
    if rule is Reduce.SUM:
        return sum(v for v, _ in vals)
    if rule is Reduce.MAX:
        return max(v for v, _ in vals)
    if rule is Reduce.RANK0 or total == 0:
        return vals[0][0]
    w = [(v, s) for v, s in vals if s > 0]  # SEQ_MEAN: each rank's mean over its share of the step's sequences
    return sum(v * s for v, s in w) / sum(s for _, s in w) if w else vals[0][0]


def reduce_rank_metrics(per_rank: Sequence[dict[str, float]], record: type = TrainResult) -> Any:
    """One step's `record` (TrainResult, SftStepResult) from each rank's metrics: every field by the `Reduce` it
    declares; the objective's and telemetry's statistics (TrainResult.per_seq) weighted by each rank's sequences."""
    by_metric = {f.metadata["metric"]: f for f in fields(record) if f.metadata.get("metric")}
    open_ended = "per_seq" in {f.name for f in fields(record)}
    total = sum(m.get("train/seqs", 0.0) for m in per_rank)
    kw: dict[str, Any] = {}
    per_seq: dict[str, float] = {}
    for k in dict.fromkeys(k for m in per_rank for k in m):
        vals = [(m[k], m.get("train/seqs", 0.0)) for m in per_rank if k in m]
        if k.startswith(_ROUTING) and open_ended:
            kw["routing_replay"] = k[len(_ROUTING):]
        elif k in by_metric:
            f = by_metric[k]
            kw[f.name] = _combine(f.metadata["reduce"], vals, total)
        elif open_ended and not k.startswith(_TRAINER_FAMILIES):
            per_seq[k] = _combine(Reduce.SEQ_MEAN, vals, total)
        else:
            raise ValueError(f"trainer metric {k!r} has no field in {record.__name__} (rl/types.py): declare it there "
                             "with how ranks combine it")
    if kw.get("tokens_per_s") is not None and (kw.get("step_s") or 0.0) > 0:  # the step's tokens over its slowest rank
        kw["tokens_per_s"] = kw["tokens"] / kw["step_s"]
    return record(**kw, per_seq=per_seq) if open_ended else record(**kw)

class TrainerLostError(RuntimeError):
    """A trainer rank died (its process or its node): the step cannot complete; the run resumes from its checkpoint."""


class TrainerStepError(RuntimeError):
    """Trainer ranks' calls failed (their processes alive): the message has each failed rank's own error."""


@dataclass(frozen=True)
class RankProcess:
    """Where one trainer rank runs: what the report of its death names."""

    rank: int
    pid: int
    node: str  # the node's address
    log: str  # the file its stderr goes to ("" if unknown)


# How long a failed call waits for Ray to mark a rank dead: when one rank's process dies mid-collective, its
# peer's call usually fails first (gloo: "Connection closed by peer"), a moment before Ray reports the death.
_DEATH_WAIT_S = 10.0


# How long the ranks' placement group may wait for its bundles. A cluster whose resources are there places it in
# seconds; one that waits this long is short of them (or an autoscaler did not add a node in this time).
PLACEMENT_TIMEOUT_S = 300.0


class TrainerPlacementError(RuntimeError):
    """The trainer ranks' bundles could not be placed on the cluster in time; the message says what was asked."""


def placement_problem(bundles: Sequence[dict[str, float]], strategy: str, cluster: dict[str, float],
                      available: dict[str, float], waited_s: float) -> str:
    """Why the placement group of `bundles` did not place: each resource asked for in all against the cluster's
    total and what is free now, the per-bundle size and the strategy, and the config keys that set them."""
    asked: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            asked[k] = asked.get(k, 0.0) + v
    rows = [f"{k} {v:g} (cluster {cluster.get(k, 0.0):g}, free {available.get(k, 0.0):g})" for k, v in asked.items()]
    short = [k for k, v in asked.items() if v > cluster.get(k, 0.0) + 1e-9]
    why = (f"the cluster has less {', '.join(short)} than asked in all" if short else
           "the cluster has these resources in all, but not free, or not on the nodes the strategy needs "
           f"({strategy}: {'all bundles on one node' if strategy == 'STRICT_PACK' else 'one bundle a node' if strategy == 'STRICT_SPREAD' else 'as few nodes as fit'})")
    return (f"trainer ranks not placed in {waited_s:.0f} s: {len(bundles)} bundle(s) of {bundles[0] if bundles else {}}, "
            f"strategy {strategy}; asked in all: {'; '.join(rows)}; {why}. Set by trainer.num_workers, trainer.cpus_per_rank, "
            "trainer.gpus_per_rank and trainer.node_resource")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """The trainer ranks of a run, behind the calls the driver makes on "the trainer"."""

    def __init__(self, workers: list[Any], micro_batch_size: "int | MicroBatching", placement_group: Any = None,
                 sequence_parallel_size: int = 1) -> None:
        self.workers = workers
        self.micro_batch_size = micro_batch_size
        # Each group of this many consecutive ranks shares every sequence (rl/trainer/ulysses.py): they get one shard.
        self.sequence_parallel_size = sequence_parallel_size
        self.placement_group = placement_group
        self.processes: list[RankProcess] = []  # filled by `ready`

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @classmethod
    def start(cls, model_dir: str, spec: Any, objective: Any, *, num_ranks: int = 1,
              resources: TrainerResources = TrainerResources(), env: dict[str, str] | None = None,
              placement_strategy: str = "PACK", critic: Any = None,
              placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> "TrainerGroup":
        """Reserve the ranks' bundles (at most `placement_timeout_s` seconds, else `TrainerPlacementError` naming
        what was asked and what the cluster has), start a worker in each and join them in one process group."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rl.trainer.actor import TrainerWorker

        bundles = [resources.bundle() for _ in range(num_ranks)]
        pg = placement_group(bundles, strategy=placement_strategy)
        ready, _ = ray.wait([pg.ready()], timeout=placement_timeout_s)
        if not ready:  # Ray waits for a placement forever; say what could not be placed instead
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
            raise TrainerPlacementError(placement_problem(bundles, placement_strategy, ray.cluster_resources(),
                                                          ray.available_resources(), placement_timeout_s))
        ray.get(ready[0])
        # The rendezvous lives on rank 0's node: start rank 0 first and ask it for its address.
        actor = ray.remote(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_restarts=0)(TrainerWorker)

        def make(rank: int, port: int | None, addr: str | None):
            return actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank)).remote(
                model_dir, spec, objective, env, rank=rank, world_size=num_ranks, master_port=port, master_addr=addr,
                critic=critic)

        if num_ranks == 1:
            workers = [make(0, None, None)]
        else:
            probe = ray.remote(num_cpus=0)(_Probe).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0)).remote()
            addr, port = ray.get(probe.address.remote())
            ray.kill(probe)
            workers = [make(r, port, addr) for r in range(num_ranks)]
        return cls(workers, spec.micro, pg, getattr(spec, "sequence_parallel_size", 1))

    # ------------------------------------------------------------------ batch sharding
    def _rank_parts(self, batch: TrainBatch) -> list[list[int]]:
        """Each rank's rows: whole micro-batches dealt to the world_size / N sequence-parallel groups
        (`split_micro_batches`), every rank of a group with its group's rows."""
        sp = self.sequence_parallel_size
        groups = split_micro_batches(batch, self.world_size // sp, self.micro_batch_size)
        return [groups[r // sp] for r in range(self.world_size)]

    def _shards(self, batch: TrainBatch, parts: list[list[int]] | None = None) -> tuple[list[tuple[TrainBatch, bool]], int]:
        """Each rank's (shard, pad_only) and the common micro-batch count; `parts`: the rows of each
        rank when the caller already has them (`split_micro_batches`)."""
        if self.world_size == 1:
            return [(batch, False)], 0
        if parts is None:
            parts = self._rank_parts(batch)
        shards = [(batch.select(p), False) if p else (batch.select([0]), True) for p in parts]
        n_micro = max(len(micro_rows(s, self.micro_batch_size)) if not pad else 0 for s, pad in shards)
        return shards, n_micro

    def _get(self, refs: Any) -> Any:
        """`ray.get` of rank calls. A rank whose process or node is gone raises `TrainerLostError` naming
        that rank, why it exited and where its log is, also when a surviving rank's call failed first
        (its collective's peer vanished): the survivor's error says only that a peer went away."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(refs)
        except (RayActorError, RayTaskError) as e:
            dead = self._dead_ranks(wait_s=_DEATH_WAIT_S if not isinstance(e, RayActorError) else 0.0)
            if not dead and isinstance(e, RayActorError):
                ids = [w._actor_id.hex() for w in self.workers]
                dead = [(ids.index(e.actor_id) if e.actor_id in ids else -1, e)]
            if not dead:
                failed = self._rank_failures(refs)
                if len(failed) > 1 or (failed and isinstance(refs, list) and len(refs) > 1):
                    raise TrainerStepError("; ".join(f"trainer rank {r} failed: {self._last_line(err)}"
                                                     for r, err in failed)) from e
                raise
            raise TrainerLostError(
                "; ".join(self._death_line(rank, err) for rank, err in dead) + ". A lost rank fails the step, and "
                "the driver does not restart the trainer: run `jointrl train` again with the same config to resume "
                "from the run's last checkpoint (trainer.resume=true)") from e

    def _rank_failures(self, refs: Any, wait_s: float = _DEATH_WAIT_S) -> list[tuple[int, Exception]]:
        """Each rank call of `refs` that raised, in rank order (waiting up to `wait_s` for the others to end):
        when one rank fails inside a collective its peers fail too ("Connection closed by peer"), and the
        first error in rank order is often a peer's, not the cause."""
        import ray

        if not isinstance(refs, list):
            return []
        ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        out = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except Exception as err:  # noqa: BLE001  (each rank's own error, reported together)
                out.append((rank, err))
        return out

    @staticmethod
    def _last_line(err: Exception) -> str:
        """A rank's error in one line: the innermost exception line of Ray's traceback text."""
        lines = [c.strip() for c in str(err).strip().splitlines() if c.strip()]
        return lines[-1][:500] if lines else type(err).__name__

    def _dead_ranks(self, wait_s: float) -> list[tuple[int, Exception]]:
        """The ranks whose actor is dead, each with Ray's error for it; polls up to `wait_s` for one to show."""
        import time

        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + wait_s
        while True:
            dead = []
            for rank, w in enumerate(self.workers):
                try:
                    ray.get(w.__ray_ready__.remote(), timeout=1.0)
                except RayActorError as err:
                    dead.append((rank, err))
                except GetTimeoutError:  # alive, still inside a call
                    pass
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.5)

    def _death_line(self, rank: int, err: Exception) -> str:
        """One sentence: which rank, why its process exited (Ray's death cause), where its log is."""
        lines = [c.strip() for c in str(err).strip().splitlines() if c.strip()]
        why = next((c for c in lines if "exit" in c.lower() or "killed" in c.lower()), lines[-1] if lines else "")
        proc = next((p for p in self.processes if p.rank == rank), None)
        where = (f" (pid {proc.pid} on {proc.node}; its log: {proc.log or 'in the Ray session log folder'})"
                 if proc else "")
        who = f"trainer rank {rank}" if rank >= 0 else "a trainer rank"
        return f"{who} was lost{where}: {type(err).__name__}: {why}"

    def _each(self, method: str, *args) -> list[Any]:
        return self._get([getattr(w, method).remote(*args) for w in self.workers])

    # ------------------------------------------------------------------ the driver's calls
    def ready(self) -> dict[str, Any]:
        info = self._each("ready")[0]
        self.processes = [RankProcess(r, *p) for r, p in enumerate(self._each("process"))]
        return {**info, "world_size": self.world_size}

    def version(self) -> int:
        return self._get(self.workers[0].version.remote())

    def submit_rl_step(self, batch: TrainBatch) -> list[Any]:
        """Start one update on every rank (non-blocking); `wait` returns the step's metrics."""
        shards, n_micro = self._shards(batch)
        return [w.rl_step.remote(s, n_micro, pad) for w, (s, pad) in zip(self.workers, shards)]

    def wait(self, refs: list[Any]) -> TrainResult:
        """The update's result over the ranks (`submit_rl_step`'s refs), with the group's world size."""
        return replace(reduce_rank_metrics(self._get(refs)), world_size=self.world_size)

    def rl_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update, waited for: its metrics by name (tests and benchmarks; the driver uses submit / wait)."""
        return self.wait(self.submit_rl_step(batch)).as_metrics()

    def sft_step(self, batch: TrainBatch) -> SftStepResult:
        shards, n_micro = self._shards(batch)
        return reduce_rank_metrics(self._get([w.sft_step.remote(s, n_micro, pad) for w, (s, pad) in zip(self.workers, shards)]),
                                   SftStepResult)

    def _gather_rows(self, method: str, batch: TrainBatch):
        """A per-row result (logprobs [B, T]) computed on the ranks' shards, back in batch order."""
        import torch

        if self.world_size == 1:
            return self._get(getattr(self.workers[0], method).remote(batch))
        parts = self._rank_parts(batch)
        shards, n_micro = self._shards(batch, parts)
        padded = method in ("compute_logprobs", "values")  # forwards through a (possibly ZeRO-3) engine
        args = [(s, n_micro, pad) if padded else (s,) for s, pad in shards]
        outs = self._get([getattr(w, method).remote(*a) for w, a in zip(self.workers, args)])
        lp = [o[0] if method == "compute_logprobs" else o for o in outs]
        full = torch.zeros_like(batch.loss_mask_BT)
        for p, x in zip(parts, lp):
            if p:
                full[torch.as_tensor(p)] = x
        return (full, None) if method == "compute_logprobs" else full

    def compute_logprobs(self, batch: TrainBatch):
        """Trainer logprobs [B, T] under the current weights (routes are not returned for N > 1)."""
        return self._gather_rows("compute_logprobs", batch)

    def reference_logprobs(self, batch: TrainBatch):
        return self._gather_rows("reference_logprobs", batch)

    def values(self, batch: TrainBatch):
        """Critic values V(s_t) [B, T] on generated tokens (0 elsewhere)."""
        return self._gather_rows("values", batch)

    def load_reference(self, model_dir: str) -> None:
        self._each("load_reference", model_dir)

    def set_lr(self, lr: float) -> None:
        self._each("set_lr", lr)

    def use_base_reference(self) -> None:
        """LoRA: the KL reference is the base (adapters off) on every rank (PolicyTrainer.use_base_reference)."""
        self._each("use_base_reference")

    def export_weights(self, *args, **kw) -> list[Any]:
        return self._get([w.export_weights.remote(*args, **kw) for w in self.workers])[0]

    def save_hf(self, out_dir: str) -> str:
        return self._each("save_hf", out_dir)[0]

    def save_checkpoint(self, ckpt_dir: str, client_state: dict | None = None) -> None:
        self._each("save_checkpoint", ckpt_dir, client_state)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self._each("load_checkpoint", ckpt_dir)[0]

    def memory(self) -> list[dict[str, float]]:
        """Each rank's resident memory (TrainerWorker.memory), in rank order."""
        return self._each("memory")

    def close_sync(self) -> None:
        self._each("close_sync")

    def node_ids(self) -> list[str]:
        return self._get([w.node_id.remote() for w in self.workers])

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass


class _Probe:
    """Runs on rank 0's bundle to name the rendezvous address and a free port there."""

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()
