"""The HF transformers reference for engine tests, computed in a fresh child process.

vLLM patches HF model classes process-wide once an engine starts, so the reference logprobs and
greedy continuations come from `python -m tests.helpers.reference JOB.json` in a new interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests import REPO


@dataclass(frozen=True)
class ReferenceJob:
    """What the HF reference process computes, for each of `num_steps + 1` weight states.

    State 0 is the checkpoint as saved; state s >= 1 adds seeded Gaussian noise (`perturb_scale` x the
    tensor's std) to every >= 2-D parameter of state s-1, in the trainer's in-memory (fused) layout.
    For each state it records teacher-forced logprobs of `sequences` and greedy continuations of
    `prompts`, and saves the in-memory state dict (what a trainer would sync) to `out_dir/state_{s}.pt`.
    """

    checkpoint: str
    out_dir: str
    sequences: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...], ...] = ()
    greedy_new_tokens: int = 8
    num_steps: int = 0
    perturb_scale: float = 0.05
    seed: int = 1234
    dtype: str = "float32"
    # Per sequence: base64 PNGs feeding its `<|image|>` runs in order (HybridMoe; model/vision.py); () = none.
    images: tuple[tuple[str, ...], ...] = ()


def run_reference(job: ReferenceJob, timeout_s: float = 600.0) -> list[dict]:
    """Run `job` in a fresh Python process (vLLM may have patched HF classes in this one).

    Returns one dict per state: {"logprobs": [np.ndarray [T-1]], "greedy": [tuple[int]], "state_path": str}.
    """
    import json
    import subprocess
    import sys

    import numpy as np
    import torch

    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    job_path = Path(job.out_dir, "job.json")
    job_path.write_text(json.dumps(job.__dict__))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.reference", str(job_path)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"HF reference process failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    out = torch.load(Path(job.out_dir, "reference.pt"))
    return [
        {"logprobs": [np.asarray(x, dtype=np.float64) for x in st["logprobs"]], "greedy": [tuple(g) for g in st["greedy"]], "state_path": st["state_path"]}
        for st in out
    ]


def _reference_main(job_path: str) -> None:
    import json

    import torch
    from transformers import AutoModelForCausalLM

    job = ReferenceJob(**json.loads(Path(job_path).read_text()))
    if json.loads(Path(job.checkpoint, "config.json").read_text()).get("model_type") == "hybrid_moe":
        import model  # noqa: F401  (registers HybridMoe with transformers' Auto classes)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.dtype]
    model = AutoModelForCausalLM.from_pretrained(job.checkpoint, dtype=dtype)
    model.eval()
    pixels: list = [None] * len(job.sequences)
    if job.images:
        import base64

        from model.vision import VisionSpec, decode_image, pixel_tensor

        spec = VisionSpec.from_config(model.config)
        pixels = [[pixel_tensor(decode_image(base64.b64decode(b), spec)) for b in row] or None for row in job.images]
    gen = torch.Generator().manual_seed(job.seed)
    states = []
    for step in range(job.num_steps + 1):
        if step > 0:
            with torch.no_grad():
                for _, p in model.named_parameters():
                    if p.dim() >= 2:
                        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                        p.add_((noise * job.perturb_scale * p.float().std()).to(p.dtype))
        logprobs = []
        with torch.no_grad():
            for seq, px in zip(job.sequences, pixels):
                ids_1T = torch.tensor([seq])
                logits_1TV = (model(ids_1T, pixel_values=px) if px is not None else model(ids_1T)).logits.float()
                lp_TV = torch.log_softmax(logits_1TV[0, :-1], dim=-1)
                logprobs.append(lp_TV.gather(1, ids_1T[0, 1:, None])[:, 0].double().tolist())
            greedy = []
            for prompt in job.prompts:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=job.greedy_new_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                greedy.append(out[0, len(prompt):].tolist())
        state_path = str(Path(job.out_dir, f"state_{step}.pt"))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, state_path)
        states.append({"logprobs": logprobs, "greedy": greedy, "state_path": state_path})
    torch.save(states, Path(job.out_dir, "reference.pt"))


if __name__ == "__main__":
    import sys

    _reference_main(sys.argv[1])
