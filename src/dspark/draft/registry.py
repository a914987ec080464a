"""Turn a --drafter value into a Drafter for a given target."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dspark.draft.base import Drafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.errors import DsparkError

DRAFTER_CHOICES = ("auto (optionally auto@RULE) | none | prompt-lookup | PATH to a drafter checkpoint directory, "
                   "optionally PATH@RULE")
VERIFY_RULES = "full | dspark | threshold:C"  # how many of a confidence-head drafter's drafts to verify
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


def resolve_drafter_spec(spec: str | None, target, rule: str = "dspark") -> str | None:
    """`auto` becomes the bundled drafter of `target` with verification rule `rule` (default: the
    hardware-aware one, `PATH@dspark`), `auto@RULE` the same with RULE; prompt-lookup when dspark
    ships none."""
    if spec is None or not (spec == "auto" or spec.startswith("auto@")) or Path(spec).exists():
        return spec
    if spec != "auto":
        rule = spec.removeprefix("auto@")
        parse_rule(rule, f" in {spec!r}")
    path = bundled_drafter(target)
    return f"{path}@{rule}" if path else "prompt-lookup"


def split_spec(spec: str) -> tuple[str, str]:
    """`PATH@RULE` -> (PATH, RULE); RULE is full (verify every draft, the default), dspark (stop
    where one more draft no longer raises expected tokens per second of the profiled target) or
    threshold:C (verify while the calibrated prefix survival >= C)."""
    base, sep, rule = spec.rpartition("@")
    if not sep or Path(spec).exists():
        return spec, "full"
    parse_rule(rule, f" in {spec!r}")
    return base, rule


def parse_rule(rule: str, where: str = "") -> tuple[str, str]:
    """A verification rule's (name, argument): full, dspark or threshold:C."""
    name, _, arg = rule.partition(":")
    if not ((name in ("full", "dspark") and not arg) or name == "threshold"):
        raise DsparkError(f"unknown verification rule {rule!r}{where}; choose {VERIFY_RULES}")
    return name, arg


def check_drafter_spec(spec: str | None) -> None:
    """Fail early (before a model loads) on a --drafter value that names nothing."""
    if spec in (None, "auto", "none", "prompt-lookup"):
        return
    base, _ = split_spec(spec)
    if base == "auto" and not Path(spec).exists():
        return
    if not Path(base).expanduser().exists():
        raise DsparkError(f"drafter {spec!r} is neither a known drafter ({DRAFTER_CHOICES}) nor an existing path")


def drafter_digest(spec: str) -> str:
    """A drafter's identity for resumable runs: a checkpoint's config (calibration included) and
    weights with its verification rule, or the name of a model-free drafter."""
    base, rule = split_spec(spec)
    path = Path(base)
    if not path.is_dir():
        return spec
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return f"{h.hexdigest()[:16]}@{rule}"


def load_drafter(spec: str | None, target, num_draft_tokens: int | None = None) -> Drafter | None:
    """The drafter a --drafter value names (its `@RULE` is the policy's business: `spec_rule`)."""
    spec = resolve_drafter_spec(spec, target)
    if spec in (None, "none"):
        return None
    if spec == "prompt-lookup":
        return PromptLookupDrafter(num_draft_tokens or 4)
    check_drafter_spec(spec)
    from dspark.draft.checkpoint import load_drafter_checkpoint

    return load_drafter_checkpoint(Path(split_spec(spec)[0]).expanduser(), target, num_draft_tokens)


def spec_rule(spec: str | None) -> str:
    """The verification rule of a (resolved) --drafter value: PATH@RULE's RULE, else full."""
    return split_spec(spec)[1] if spec not in (None, "none", "prompt-lookup") else "full"
