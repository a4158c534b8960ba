"""The CAD kernel side of cad-v0: code that imports cadquery.

`geometry.py` (solid checks, summaries, through-hole count, exact volume IoU, feature checks, meshes
for rendering) and `brep.py` (the static scan of BREP text, pure Python) are shared by the
in-sandbox runner (`runner.py`, which executes the agent's code and reports on the agent's own
solid) and the trusted grading side (`envs/cad/worker.py`). They depend only on the standard
library, numpy and cadquery, because this directory is mounted read-only into the agent's sandbox
and run there without the rest of the repository.
"""
