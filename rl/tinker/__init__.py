"""A Tinker-compatible training service (`jointrl tinker serve MODEL`, docs/tinker.md).

The official `tinker` SDK drives it unchanged but for its base URL: LoRA training clients backed by the
project's DeepSpeed policy trainer (rl/trainer) and the losses of rl/algos, sampling clients backed by a
vLLM rollout engine (rl/rollout/engine.py) fed through the weight-sync export (rl/weights).
Modules: `app` (HTTP routes, auth, CLI), `service` (sessions, models, futures, queues, ownership),
`models` (the trainer and the shared engine), `losses` (Tinker's losses on rl/algos), `sampling`
(sample requests), `wire` (the protobuf bodies), `records` (the JSON bodies).
"""
