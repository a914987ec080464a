"""`Target`: the handle every room passes around — the runner's model, its tokenizer, where it came from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dspark.errors import DsparkError
from dspark.model.config import TargetConfig
from dspark.model.transformer import TargetModel


@dataclasses.dataclass
class Target:
    model: TargetModel
    tokenizer: object | None  # a transformers tokenizer (None only for tokenizer-less test models)
    path: Path
    eos_token_ids: frozenset[int]

    @property
    def cfg(self) -> TargetConfig:
        return self.model.cfg

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise DsparkError(f"{self.path} has no tokenizer; pass token ids, not text")

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for a user message rendered with the chat template (or raw text)."""
        self._require_tokenizer()
        if not text:
            raise DsparkError("the prompt is empty; pass some text with --prompt")
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the assistant's reply."""
        self._require_tokenizer()
        if not getattr(self.tokenizer, "chat_template", None):
            raise DsparkError(f"{self.path} has no chat template; send raw text to /v1/completions instead")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2 errors raised by the template itself (e.g. role order)
            raise DsparkError(f"the chat template rejected these messages: {e}") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def check_token_ids(self, ids: list[int], what: str) -> None:
        """Refuse token ids outside the vocabulary; `what` names them in the message."""
        if bad := [i for i in ids if not 0 <= i < self.cfg.vocab_size]:
            raise DsparkError(f"{what} {bad[:5]} are outside the vocabulary (0..{self.cfg.vocab_size - 1})")

    def decode(self, ids: list[int]) -> str:
        self._require_tokenizer()
        return self.tokenizer.decode(ids, skip_special_tokens=True)
