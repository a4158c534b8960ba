"""Tiny local checkpoints (random weights + a locally trained byte-level BPE) for tests and benchmarks.

No hub access exists on the build machines, so every model the rollout tests and
`scripts/bench_rollout.py` use is built here from a transformers config class with random weights
and written with `save_pretrained`, next to a tokenizer trained in a second on a built-in corpus.
The tokenizer carries the special tokens the rollout path relies on (`<think>`, `</think>`,
`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`), each a single token.

What this module does not do: ship a real model or tokenizer (that is `model/`), or anything at
run time of a training job.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")

# A small, varied English corpus; the tokenizer only needs to be a real BPE, not a good one.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "ls -la /tmp && cat README.md | grep install",
    "Reinforcement learning trains a policy from rewards collected in an environment.",
    "A mixture of experts routes each token to a few expert networks chosen by a router.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
    "The box is 40 mm wide, 20 mm deep and 6 mm thick, with four holes of 8 mm diameter.",
    "Search the documentation for the function signature, then open the page and read it.",
    "git diff HEAD~1 -- src/main.py; pytest -x -q tests/",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ? # $ % & @ ^ _ ` | ~",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny causal LM. head_dim must be one vLLM's CPU attention supports (64, 128, ...)."""

    kind: str = "qwen3_moe"  # "qwen3_moe" | "qwen3" | "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256  # dense MLP width (dense models)
    moe_intermediate_size: int = 64  # per-expert width (MoE); multiple of 32 so the CPU MoE kernel needs no padding
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0


def train_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on the built-in corpus and save it as a HF fast tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
    )
    fast.save_pretrained(out)
    return out


def _config(spec: TinyModelSpec, vocab_size: int, eos_id: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if spec.kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if spec.kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, **common)
    if spec.kind == "qwen2":
        from transformers import Qwen2Config

        if spec.hidden_size // spec.num_heads != spec.head_dim:
            raise ValueError(f"qwen2 derives head_dim = hidden_size / num_heads; got {spec.hidden_size}/{spec.num_heads} != {spec.head_dim}")
        return Qwen2Config(intermediate_size=spec.intermediate_size, **common)
    raise ValueError(f"TinyModelSpec.kind {spec.kind!r} is not one of 'qwen3_moe', 'qwen3', 'qwen2'")


def build_tiny_checkpoint(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), init_std: float = 0.1) -> Path:
    """Write a random-weight HF checkpoint (fp32 safetensors) plus a trained tokenizer into `out_dir`.

    `init_std` is larger than the usual 0.02 so the tiny model's next-token distributions are
    far from uniform: greedy decoding is then stable enough to compare engines token by token.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    train_tokenizer(out, spec.vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = _config(spec, vocab_size=len(tok), eos_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    cfg.initializer_range = init_std
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms stay at their identity init: random norm scales make a tiny model chaotic
                continue
            p.normal_(0.0, init_std)
    model.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- HF reference (run in a child process)
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
        [sys.executable, "-m", "rl.rollout.testing", str(job_path)],
        cwd=str(Path(__file__).resolve().parents[2]),
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


def build_hybrid_checkpoint(out_dir: str | Path, config_name: str = "tiny", seed: int = 0, **overrides) -> Path:
    """A random-weight `HybridMoeForCausalLM` checkpoint (shipped config) plus the project's tokenizer."""
    import shutil

    import torch

    import model  # noqa: F401
    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    m = HybridMoeForCausalLM(load_shipped_config(config_name, **overrides))
    m.save_pretrained(out)
    tok_dir = Path(__file__).resolve().parents[2] / "model" / "tokenizer"
    for f in tok_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    return out


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
            for seq in job.sequences:
                ids_1T = torch.tensor([seq])
                logits_1TV = model(ids_1T).logits.float()
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
