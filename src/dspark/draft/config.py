"""Drafter configuration: what `config.json` of a drafter checkpoint holds (DESIGN.md §8)."""

from __future__ import annotations

import dataclasses

from dspark.errors import DsparkError
from dspark.model.config import TargetConfig

HEAD_TYPES = ("vanilla", "gated", "rnn", "none")  # "none" = DFlash mode (no sequential head)
DRAFT_LAYERS = ("qwen3", "target")
# how the tapped target features reach the draft layers: shared = DFlash's one projection of their
# concatenation, read by every layer; layerwise = DFlare's per-layer softmax mixture of them, with
# context key / value projections of each layer's own
CONTEXT_FUSIONS = ("shared", "layerwise")
LAYERWISE_TAPS = 9  # tapped layers a layer-wise drafter spreads over the target by default (DFlare's)
EMBEDDING_TAP = -1  # a tapped layer id that means the embedding output (DeepSpec's convention)
_ARCH_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_KINDS = ("DSparkModel", "DFlashModel", "Eagle3Model")  # after a family prefix: Qwen3DSparkModel, ...


def default_tap_layers(num_target_layers: int, count: int = 5) -> list[int]:
    """`count` layer ids spread over the depth, never the last layer (DFlash's spread: 1 .. L-3)."""
    if num_target_layers < 2:
        raise DsparkError("the target needs at least 2 decoder layers to tap features from")
    lo, hi = (1, num_target_layers - 3) if num_target_layers >= 6 else (0, num_target_layers - 2)
    count = min(count, hi - lo + 1)
    if count == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def _architecture_family(d: dict) -> str | None:
    """The family prefix of a drafter's architecture name (`Qwen3DSparkModel` -> qwen3), or None for
    `DSparkDraftModel` (vLLM's name, which leaves the family to `model_type`)."""
    archs = d.get("architectures") or []
    for arch in archs:
        if arch == "DSparkDraftModel":
            return None
        for family, prefix in _ARCH_PREFIX.items():
            if arch.startswith(prefix) and arch.removeprefix(prefix) in _KINDS:
                return family
    raise DsparkError(f"not a dspark / DeepSpec drafter config (architectures={archs!r})")


def _target_family(d: dict) -> str:
    """The family of the target a drafter config was made for: dspark records it apart from the
    draft layer's architecture (a Qwen3-style drafter may serve a Llama target); DeepSpec's configs
    are copies of their Qwen3 target's."""
    family = d.get("dspark_target_model_type") or _architecture_family(d) or d.get("model_type")
    if family not in _ARCH_PREFIX:
        raise DsparkError(f"drafter config.json names an unsupported target family {family!r}")
    return family


@dataclasses.dataclass
class DraftConfig:
    target: TargetConfig  # shape of the target (the draft layers copy it)
    target_layer_ids: list[int]
    block_size: int = 8  # γ: draft tokens per block (the anchor is slot 0)
    num_hidden_layers: int = 1  # draft layers
    markov_head_type: str = "vanilla"
    markov_rank: int = 32
    enable_confidence_head: bool = True
    mask_token_id: int = 0
    num_anchors: int = 32  # training default: anchors sampled per sequence
    kind: str = "dspark"  # dspark (parallel block drafter, incl. DFlash mode) | eagle3 (autoregressive)
    # confidence on [h ; W1[prev]] (True) or on h alone; None = with the Markov input when there is one
    confidence_head_with_markov: bool | None = None
    # qwen3: DeepSpec's draft layer (q/k RMSNorm, biases only with attention_bias) whatever the target;
    # target: the target family's own layer shape (dspark's first drafters; EAGLE-3). None = qwen3 for
    # DSpark / DFlash, target for EAGLE-3
    draft_layer: str | None = None
    attention_bias: bool = False  # qwen3 draft layers: biases on q/k/v/o
    # K: the drafter drafts over the K most frequent target tokens (draft/vocab.py); 0 = all of them
    draft_vocab_size: int = 0
    context_fusion: str = "shared"  # one of CONTEXT_FUSIONS

    def __post_init__(self):
        L = self.target.num_hidden_layers
        if self.kind not in ("dspark", "eagle3"):
            raise DsparkError(f"unknown drafter kind {self.kind!r}")
        if self.draft_layer is None:
            self.draft_layer = "target" if self.kind == "eagle3" else "qwen3"
        if self.kind == "eagle3" and self.draft_layer != "target":
            raise DsparkError("an EAGLE-3 drafter uses the target's own layer shape (draft_layer = target)")
        if self.draft_layer not in DRAFT_LAYERS:
            raise DsparkError(f"unknown draft layer {self.draft_layer!r}; choose one of {', '.join(DRAFT_LAYERS)}")
        if self.confidence_head_with_markov is None:
            self.confidence_head_with_markov = self.enable_confidence_head and self.has_sequential_head
        if self.confidence_head_with_markov and not (self.enable_confidence_head and self.has_sequential_head):
            raise DsparkError("confidence_head_with_markov needs a confidence head and a sequential head")
        if self.kind == "eagle3" and (self.has_sequential_head or self.enable_confidence_head or self.num_hidden_layers != 1):
            raise DsparkError("an EAGLE-3 drafter has one layer and no sequential or confidence head")
        if self.context_fusion not in CONTEXT_FUSIONS:
            raise DsparkError(f"unknown context fusion {self.context_fusion!r}; choose one of "
                              f"{', '.join(CONTEXT_FUSIONS)}")
        if self.layerwise_fusion and (self.kind != "dspark" or self.draft_layer != "qwen3"):
            raise DsparkError("layer-wise context fusion is for DSpark / DFlash drafters with Qwen3-style layers")
        if self.block_size < 2:
            raise DsparkError(f"block size must be >= 2, got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise DsparkError(f"a drafter needs >= 1 layer, got {self.num_hidden_layers}")
        if self.markov_head_type not in HEAD_TYPES:
            raise DsparkError(f"unknown head type {self.markov_head_type!r}; choose one of {', '.join(HEAD_TYPES)}")
        if self.has_sequential_head and self.markov_rank < 1:
            raise DsparkError(f"markov rank must be >= 1 for a {self.markov_head_type} head, got {self.markov_rank}")
        if not self.target_layer_ids:
            raise DsparkError("a drafter needs at least one tapped target layer")
        bad = [i for i in self.target_layer_ids if not EMBEDDING_TAP <= i < L]
        if bad:
            raise DsparkError(f"tapped layer ids {bad} are out of range for a {L}-layer target "
                              f"(valid: 0..{L - 1}, or -1 for the embedding output)")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise DsparkError(f"tapped layer ids repeat: {self.target_layer_ids}")
        if self.draft_vocab_size == self.target.vocab_size:
            self.draft_vocab_size = 0
        if not 0 <= self.draft_vocab_size <= self.target.vocab_size:
            raise DsparkError(f"draft vocabulary size {self.draft_vocab_size} is outside 1..{self.target.vocab_size} "
                              f"(0 for the full vocabulary)")
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise DsparkError(f"mask token id {self.mask_token_id} is outside the vocabulary (0..{self.target.vocab_size - 1})")

    @property
    def has_sequential_head(self) -> bool:
        return self.markov_head_type != "none"

    @property
    def layerwise_fusion(self) -> bool:
        """Each draft layer mixes the taps its own way (DFlare) instead of reading one shared projection."""
        return self.context_fusion == "layerwise"

    @property
    def head_rank(self) -> int:
        """Width of the previous-token embedding W1 (0 without a sequential head)."""
        return self.markov_rank if self.has_sequential_head else 0

    @property
    def dflash(self) -> bool:
        return not self.has_sequential_head and not self.enable_confidence_head

    @property
    def layer_qk_norm(self) -> bool:
        """Whether the draft layers normalise queries and keys per head (RMSNorm before RoPE)."""
        return self.draft_layer == "qwen3" or self.target.qk_norm

    @property
    def layer_qkv_bias(self) -> bool:
        return self.attention_bias if self.draft_layer == "qwen3" else self.target.attention_bias

    @property
    def layer_o_bias(self) -> bool:
        return self.attention_bias and self.draft_layer == "qwen3"

    def to_dict(self) -> dict:
        """config.json. Qwen3-layer drafters are named as DeepSpec names them (`Qwen3DSparkModel`,
        `model_type: qwen3`, DFlash mode included) and record the target's family apart."""
        t = self.target
        d = {k: v for k, v in t.to_hf_dict().items() if k not in ("architectures", "num_hidden_layers")}
        if self.draft_layer == "qwen3" and self.kind == "dspark":
            arch = "Qwen3DSparkModel"
            d.update(model_type="qwen3", attention_bias=self.attention_bias, dspark_target_model_type=t.family,
                     layer_types=["full_attention"] * self.num_hidden_layers)
        else:
            kind = "Eagle3Model" if self.kind == "eagle3" else "DFlashModel" if self.dflash else "DSparkModel"
            arch = _ARCH_PREFIX[t.family] + kind
        d.update(
            architectures=[arch],
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=t.num_hidden_layers,
            num_hidden_layers=self.num_hidden_layers,
            markov_rank=self.head_rank,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov,
            num_anchors=self.num_anchors,
            draft_vocab_size=self.draft_vocab_size or t.vocab_size,  # EAGLE-3 / DeepSpec: V when not reduced
        )
        if self.layerwise_fusion:  # dspark's own field; absent = DeepSpec's shared projection
            d["context_fusion"] = self.context_fusion
        if not self.has_sequential_head:
            d.pop("markov_head_type")  # DeepSpec writes the head type only with a head (rank > 0)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        try:
            family = _target_family(d)
            target = TargetConfig.from_hf_dict(
                dict(d, architectures=[TargetConfig.hf_architecture(family)], num_hidden_layers=d["num_target_layers"])
            )
            head = d.get("markov_head_type", "vanilla")
            rank = int(d.get("markov_rank", 0))
            if rank == 0:
                head = "none"
            kind = "eagle3" if any("Eagle3" in a for a in d.get("architectures") or []) else "dspark"
            qwen3_layer = kind == "dspark" and _architecture_family(d) in (None, "qwen3")
            confidence = bool(d.get("enable_confidence_head", False))
            with_markov = d.get("confidence_head_with_markov")
            return cls(
                target=target,
                target_layer_ids=[int(i) for i in d["target_layer_ids"]],
                block_size=int(d["block_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                markov_head_type=head,
                markov_rank=rank,
                enable_confidence_head=confidence,
                mask_token_id=int(d["mask_token_id"]),
                num_anchors=int(d.get("num_anchors", 32)),
                kind=kind,
                confidence_head_with_markov=bool(with_markov) and confidence if with_markov is not None else None,
                draft_layer="qwen3" if qwen3_layer else "target",
                attention_bias=bool(d.get("attention_bias", False)) if qwen3_layer else False,
                draft_vocab_size=int(d.get("draft_vocab_size", target.vocab_size)),
                context_fusion=str(d.get("context_fusion", "shared")),
            )
        except KeyError as e:
            raise DsparkError(f"drafter config.json lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise DsparkError(f"drafter config.json has an invalid value: {e}") from None
