"""Turn a --drafter value into a Drafter for a given target."""

from __future__ import annotations

from pathlib import Path

from dspark.draft.base import Drafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.errors import DsparkError

DRAFTER_CHOICES = "none | prompt-lookup | PATH to a drafter checkpoint directory"


def load_drafter(
    spec: str | None, target, num_draft_tokens: int | None = None, confidence_threshold: float | None = None
) -> Drafter | None:
    if spec in (None, "none"):
        return None
    if confidence_threshold is not None and spec in ("prompt-lookup",):
        raise DsparkError("--confidence-threshold needs a drafter with a confidence head")
    if spec == "prompt-lookup":
        return PromptLookupDrafter(num_draft_tokens or 4)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DsparkError(f"drafter {spec!r} is neither a known drafter ({DRAFTER_CHOICES}) nor an existing path")
    from dspark.draft.checkpoint import load_drafter_checkpoint

    return load_drafter_checkpoint(path, target, num_draft_tokens, confidence_threshold)
