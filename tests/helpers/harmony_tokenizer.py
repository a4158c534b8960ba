"""The harmony (o200k_harmony) tokenizer of `openai_harmony`, with the few tokenizer methods the codec and
vLLM's harmony parser call: for tests, where no gpt-oss checkpoint (and its HF tokenizer) is at hand."""
from __future__ import annotations

from functools import cached_property
from typing import Sequence


class HarmonyTokenizer:
    def __init__(self) -> None:
        import openai_harmony as h

        self.enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        self.eos_token_id = self.enc.encode("<|return|>", allowed_special="all")[0]
        self.pad_token_id = self.enc.encode("<|endoftext|>", allowed_special="all")[0]
        self.all_special_tokens = sorted(self.enc.special_tokens_set)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.enc.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.enc.decode(list(ids))

    @cached_property
    def _vocab(self) -> dict[str, int]:
        return {t: self.encode(t)[0] for t in self.all_special_tokens}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab
