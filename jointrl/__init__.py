"""The leaf of jointrl's import graph: what every layer shares and nothing else.

- `jointrl.records`: the typed records that cross layers (messages, tool calls, tasks, limits,
  step results, grades);
- `jointrl.paths`: the repository root and the cache root;
- `jointrl.safejson`: JSON decoding of model-written text with depth and size limits (one error type).

Nothing here imports `rl`, `envs`, `rewards` or `model`, so each of them may depend on it while the
layers keep pointing one way (rl -> envs -> rewards; rl -> model).
"""
