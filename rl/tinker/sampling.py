"""A Tinker `sample` request as engine calls: validation against what the engine offers, then generate / score.

The engine (rl/rollout/engine.py) takes token prompts, max_tokens, temperature, top_p, stop token ids
and a per-request seed, and reports the sampled token's raw logprob (log-softmax of the logits at
temperature 1) and prompt logprobs through `score`. Tinker options it has no equivalent for are
refused with 400 rather than ignored: `top_k`, stop strings, top-k logprobs, target prompt logprobs,
alternative prompt tokens and stability records.

What this module does not do: choose or load weights (rl/tinker/models.py `SamplerEngine`) or queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rl.tinker.records import SampleBody
from rl.tinker.service import TinkerError
from rl.tinker.wire import WireSequence, encode_sample_response

DEFAULT_MAX_TOKENS = 64  # when sampling_params.max_tokens is left out


@dataclass(frozen=True)
class SamplePlan:
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    seed: int | None
    prompt_logprobs: bool
    last_n: int | None


def plan(body: SampleBody, vocab: int, max_model_len: int, max_samples: int) -> SamplePlan:
    """Validate a sample request (400 naming the field) and fix what the engine will be asked."""
    sp = body.sampling_params
    if any(c.type != "encoded_text" for c in body.prompt.chunks):
        raise TinkerError(400, "prompt: only encoded_text chunks are supported (no image or audio input)")
    prompt = tuple(t for c in body.prompt.chunks for t in c.tokens)
    if not prompt:
        raise TinkerError(400, "prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise TinkerError(400, f"prompt token ids must be in [0, {vocab})")
    if not 1 <= body.num_samples <= max_samples:
        raise TinkerError(400, f"num_samples must be in [1, {max_samples}], got {body.num_samples}")
    max_tokens = DEFAULT_MAX_TOKENS if sp.max_tokens is None else sp.max_tokens
    if max_tokens < 1 or len(prompt) + max_tokens > max_model_len:
        raise TinkerError(400, f"sampling_params.max_tokens={max_tokens}: prompt ({len(prompt)}) + max_tokens must be "
                               f"<= {max_model_len} and max_tokens >= 1")
    if not sp.temperature >= 0 or not 0 < sp.top_p <= 1:
        raise TinkerError(400, "sampling_params: temperature must be >= 0 and top_p in (0, 1]")
    if sp.top_k not in (-1, 0):
        raise TinkerError(400, "sampling_params.top_k is not supported by this service's engine; leave it at -1")
    stop_ids: tuple[int, ...] = ()
    ignore_eos = False
    if isinstance(sp.stop, str) or (isinstance(sp.stop, list) and sp.stop and isinstance(sp.stop[0], str)):
        raise TinkerError(400, "sampling_params.stop: stop strings are not supported; pass stop token ids")
    if isinstance(sp.stop, list):
        stop_ids = tuple(int(t) for t in sp.stop)
        ignore_eos = not stop_ids  # [] disables every stop, EOS included (the SDK's contract)
    for name, v in (("topk_prompt_logprobs", body.topk_prompt_logprobs), ("topk_sample_logprobs", body.topk_sample_logprobs),
                    ("prompt_alt_tokens_k", body.prompt_alt_tokens_k)):
        if v:
            raise TinkerError(400, f"{name} is not supported (the engine reports the sampled token's logprob only)")
    if body.target_prompt_logprobs is not None or body.record_stability_info:
        raise TinkerError(400, "target_prompt_logprobs and record_stability_info are not supported")
    want_prompt = bool(body.prompt_logprobs)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and (not want_prompt or not 1 <= last_n <= len(prompt) - 1):
        raise TinkerError(400, "prompt_logprobs_last_n needs prompt_logprobs and must be in [1, len(prompt) - 1]")
    if want_prompt and len(prompt) < 2:
        raise TinkerError(400, "prompt_logprobs needs a prompt of at least 2 tokens")
    return SamplePlan(prompt, body.num_samples, max_tokens, float(sp.temperature), float(sp.top_p), stop_ids, ignore_eos,
                      sp.seed, want_prompt, last_n)


def runner(p: SamplePlan) -> Callable[[Any], bytes]:
    """What runs on the engine for plan `p`: the `SampleResponse` protobuf bytes."""

    def run(engine: Any) -> bytes:
        from rl.rollout.engine import GenerateRequest

        reqs = [GenerateRequest(prompt_token_ids=p.prompt, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                stop_token_ids=p.stop_ids, ignore_eos=p.ignore_eos,
                                seed=None if p.seed is None else p.seed + i) for i in range(p.num_samples)]
        results = engine.generate(reqs)
        seqs = []
        for r in results:
            if r.finish_reason == "abort":
                raise RuntimeError("the engine aborted the request")
            seqs.append(WireSequence(np.asarray(r.token_ids), np.asarray(r.logprobs), r.finish_reason == "stop"))
        prompt_lp = None
        if p.prompt_logprobs:
            scored = engine.score([p.prompt])[0]  # [T - 1]: log p(prompt[t] | prompt[:t]), t >= 1
            prompt_lp = np.concatenate([[np.nan], scored]).astype(np.float32)
            if p.last_n is not None:
                prompt_lp[: len(p.prompt) - p.last_n] = np.nan
        return encode_sample_response(seqs, prompt_lp)

    return run
