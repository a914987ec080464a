"""Turn a --drafter value into a Drafter for a given target."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dspark.draft.base import Drafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.errors import DsparkError

DRAFTER_CHOICES = "auto | none | prompt-lookup | PATH to a drafter checkpoint directory"
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "drafters"  # trained drafters shipped with dspark


def bundled_drafter(target) -> Path | None:
    """The drafter dspark ships for `target` (matched by shapes and a probe of its weights), if any."""
    from dspark.draft.checkpoint import read_config, target_mismatches
    from dspark.draft.config import DraftConfig

    for path in sorted(p.parent for p in BUNDLED_DIR.glob("*/config.json")):
        raw = read_config(path)
        if not target_mismatches(DraftConfig.from_dict(raw), raw, target):
            return path
    return None


def resolve_drafter_spec(spec: str | None, target) -> str | None:
    """`auto` becomes the bundled drafter of `target`, or prompt-lookup when dspark ships none."""
    if spec != "auto":
        return spec
    path = bundled_drafter(target)
    return str(path) if path else "prompt-lookup"


def drafter_digest(spec: str) -> str:
    """A drafter's identity for resumable runs: a checkpoint's config (calibration included) and
    weights, or the name of a model-free drafter."""
    path = Path(spec)
    if not path.is_dir():
        return spec
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_drafter(
    spec: str | None, target, num_draft_tokens: int | None = None, confidence_threshold: float | None = None
) -> Drafter | None:
    spec = resolve_drafter_spec(spec, target)
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
