"""`PATH@RULE` -> a verification policy for a drafter loaded from PATH.

full (the default for a path): verify every draft; threshold:C: verify while the calibrated prefix
survival stays >= C; dspark: DSpark's Algorithm 1 on this machine's profiled SPS curve and
draft-pass cost (both measured once and cached), skipping drafting while it does not pay.
"""

from __future__ import annotations

from dspark.draft.registry import load_drafter, parse_rule, resolve_drafter_spec, spec_rule
from dspark.errors import DsparkError
from dspark.schedule.policies import ARPolicy, DSparkPolicy, Policy, ThresholdPolicy, VerifyAllPolicy


def load_speculation(spec: str | None, target, num_draft_tokens: int | None = None,
                     confidence_threshold: float | None = None, auto_rule: str = "dspark"):
    """(resolved spec, drafter or None, policy) for a --drafter value; `auto` takes `auto_rule`."""
    spec = resolve_drafter_spec(spec, target, auto_rule)
    drafter = load_drafter(spec, target, num_draft_tokens)
    return spec, drafter, rule_policy(spec_rule(spec), drafter, target, confidence_threshold)


def rule_policy(rule: str, drafter, target, confidence_threshold: float | None = None) -> Policy:
    """The policy of verification rule `rule` for `drafter` (None: plain AR) on `target`;
    `confidence_threshold` (--confidence-threshold) is the rule threshold:C given apart."""
    if drafter is None:
        return ARPolicy()
    name, arg = parse_rule(rule)
    if confidence_threshold is not None:
        if name == "threshold":
            raise DsparkError(f"the rule {rule!r} already sets a threshold; drop --confidence-threshold")
        if name == "dspark":
            raise DsparkError("the dspark verification rule and --confidence-threshold exclude each other")
        name, arg = "threshold", str(confidence_threshold)
    if name == "full":
        return VerifyAllPolicy()
    if not drafter.has_confidence:
        raise DsparkError(f"this drafter has no confidence head: the {name} verification rule needs one")
    if name == "threshold":
        try:
            return ThresholdPolicy(float(arg))
        except ValueError:
            raise DsparkError(f"threshold:C needs a number, got {rule!r}") from None
    from dspark.schedule.sps import load_or_measure, load_or_measure_draft_cost

    draft_s = load_or_measure_draft_cost(drafter, target)
    policy = DSparkPolicy(load_or_measure(target, max_tokens=drafter.max_drafts + 1, progress=False)[0])
    policy.gate.draft_seconds = lambda requests: draft_s
    return policy
