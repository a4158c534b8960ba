"""Weight sync: trainer state dict -> checkpoint-named buckets -> rollout workers, over /dev/shm or Ray's object store.

| module | does |
|---|---|
| `names` | trainer names -> checkpoint names vLLM loads (fused experts split per expert), sync units, bucket boundaries |
| `wire` | wire records (`WeightBucket`, `TensorEntry`, `Segment`), the interned index blob, `unpack_bucket` |
| `encode` | sync formats (fp32 / bf16 / MXFP4), the cacheable `SyncLayout`, `SyncPlan`, building buckets, `SyncStaging` |
| `shm` | the same-node transport: double-buffered, versioned, file-locked /dev/shm area (`ShmSyncArea`) and `ShmReader` |
| `shm_files` | the area's file names, stale-file sweep and reaper |
| `exporter` | a trainer module's weights -> plan, `export_buckets`; `WeightExporter`: cached layout, transport choice |
| `errors` | `WeightSyncError`, `ShmSyncError`, `ShmSpaceError` |

Everything public is importable from `rl.weights`. What this package does not do: send anything
through Ray (the trainer actor, dispatcher and rollout worker do), load anything into an engine
(rl/rollout/engine.py), or handle tensor-parallel shards.
"""
from __future__ import annotations

from rl.weights.encode import (SYNC_FORMATS, BucketLayout, SourceLayout, SyncFormat, SyncLayout, SyncPlan, SyncStaging, layout_key,
                               make_buckets, pack_bucket, plan_sync)
from rl.weights.errors import ShmSpaceError, ShmSyncError, WeightSyncError
from rl.weights.exporter import (TRAINER_SYNC_FORMATS, TRANSPORT_ENV, TRANSPORTS, ModuleInfo, Transport, WeightExporter,
                                 export_buckets, local_node_id, module_info, requested_transport, trainer_plan)
from rl.weights.names import checkpoint_views, expert_family, plan_buckets, tensor_bytes, to_checkpoint_format, unit_of
from rl.weights.shm import ShmBucket, ShmReader, ShmSlot, ShmSyncArea
from rl.weights.shm_files import SHM_DIR, SHM_PREFIX, proc_start_time, sweep_stale_shm
from rl.weights.wire import (Encoding, Segment, TensorEntry, WeightBucket, engine_dtype, entries_from_wire, entries_to_wire,
                             sync_bytes, total_bytes, unpack_bucket)

__all__ = [
    "SHM_DIR", "SHM_PREFIX", "SYNC_FORMATS", "TRAINER_SYNC_FORMATS", "TRANSPORTS", "TRANSPORT_ENV", "BucketLayout",
    "Encoding", "ModuleInfo", "Segment", "ShmBucket", "ShmReader", "ShmSlot", "ShmSpaceError", "ShmSyncArea",
    "ShmSyncError", "SourceLayout", "SyncFormat", "SyncLayout", "SyncPlan", "SyncStaging", "TensorEntry",
    "Transport", "WeightBucket", "WeightExporter", "WeightSyncError", "checkpoint_views", "engine_dtype",
    "entries_from_wire", "entries_to_wire", "expert_family", "export_buckets", "layout_key", "local_node_id",
    "make_buckets", "module_info", "pack_bucket", "plan_buckets", "plan_sync", "proc_start_time",
    "requested_transport", "sweep_stale_shm", "sync_bytes", "tensor_bytes", "to_checkpoint_format", "total_bytes",
    "trainer_plan", "unit_of", "unpack_bucket",
]
