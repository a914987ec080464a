"""A drafter's name -> a Drafter for a given target: none, prompt-lookup, a checkpoint directory, or
the trained drafter dspark ships for the target; a model drafter's name + `+lookup` adds prompt-lookup
branches to its trees (`draft/hybrid.py`). (How a `--drafter` value also names a verification policy,
`NAME@POLICY`, is `decode/speculation.py`'s business.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dspark.draft.base import Drafter
from dspark.draft.checkpoint import load_drafter_checkpoint, read_config, target_mismatches
from dspark.draft.config import DraftConfig
from dspark.draft.hybrid import SUFFIX, LookupBranchDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.errors import DsparkError
from dspark.model.target import Target

MODEL_FREE = ("none", "prompt-lookup")  # drafter names that load no weights
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "drafters"  # trained drafters shipped with dspark
PROMPT_LOOKUP_DRAFTS = 4  # drafts per round of single-request prompt lookup unless told otherwise


def bundled_drafter(target: Target) -> Path | None:
    """The drafter dspark ships for `target` (matched by shapes and a probe of its weights), if any."""
    for path in sorted(p.parent for p in BUNDLED_DIR.glob("*/config.json")):
        raw = read_config(path)
        if not target_mismatches(DraftConfig.from_dict(raw), raw, target):
            return path
    return None


def load_named_drafter(name: str, target: Target, num_draft_tokens: int | None = None) -> Drafter | None:
    """The drafter `name` names: None for `none`, prompt lookup, a checkpoint directory's drafter, or
    `NAME+lookup`: NAME's trees with a prompt-lookup branch."""
    if name == "none":
        return None
    if name.endswith(SUFFIX) and not Path(name).expanduser().exists():
        inner = load_named_drafter(name.removesuffix(SUFFIX), target, num_draft_tokens)
        if inner is None or isinstance(inner, PromptLookupDrafter):
            raise DsparkError(f"{name!r}: `{SUFFIX}` adds prompt-lookup branches to a model drafter's trees")
        return LookupBranchDrafter(inner)
    if name == "prompt-lookup":
        return PromptLookupDrafter(num_draft_tokens or PROMPT_LOOKUP_DRAFTS)
    return load_drafter_checkpoint(Path(name).expanduser(), target, num_draft_tokens)


def checkpoint_digest(path: Path) -> str:
    """A checkpoint directory's identity for resumable runs: its config (calibration included) and weights."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
