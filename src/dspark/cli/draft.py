"""`dspark draft init | export | convert`: drafter checkpoints."""

from __future__ import annotations

import argparse

from dspark.cli.common import command_group, open_target, positive_int, target_args
from dspark.errors import DsparkError
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    dsub = command_group(sub, "draft", "create and export drafter checkpoints",
                         "Create and export DSpark / DFlash drafter checkpoints.")
    init = dsub.add_parser(
        "init",
        help="write a freshly initialised drafter for a target",
        description="Write a freshly initialised drafter (config.json + model.safetensors) shaped for "
        "a target: the starting point for `dspark train`. Its final norm starts from the target's, the rest "
        "is random (--copy-target-layers: the draft layers start as copies of the target's last layers). "
        "The target's embedding and LM head are shared, not copied.",
    )
    target_args(init, dtype=False)
    init.add_argument("--out", required=True, help="output checkpoint directory")
    init.add_argument("--head", default="markov", choices=["markov", "vanilla", "gated", "rnn", "none"],
                      help="sequential head: markov (= vanilla), gated, rnn, or none (DFlash mode) (default markov)")
    init.add_argument("--block-size", type=positive_int, default=8, help="draft tokens per block, γ (default 8)")
    init.add_argument("--layers", type=positive_int, default=1, help="draft decoder layers (default 1)")
    init.add_argument("--tap-layers", default=None, metavar="IDS",
                      help="comma-separated target layer ids to tap, -1 = the embedding output (write "
                      "--tap-layers=-1,4,8 then) (default: 5 spread over the depth, 9 with --context-fusion layerwise; never "
                      "the last)")
    init.add_argument("--context-fusion", default="shared", choices=["shared", "layerwise"],
                      help="how the tapped target features reach the draft layers: shared = one projection of "
                      "their concatenation read by every layer (DFlash / DeepSpec; exportable) | layerwise = each "
                      "layer's own softmax mix of them and its own context key / value projections (DFlare; 9 taps "
                      "by default; dspark only)")
    init.add_argument("--markov-rank", type=positive_int, default=32, help="rank r of the sequential head (default 32)")
    init.add_argument("--mask-token-id", type=int, default=None,
                      help="token id used for MASK slots (default: an unused row or an unused special token)")
    init.add_argument("--confidence-head", action=argparse.BooleanOptionalAction, default=None,
                      help="add a confidence head (default: yes, except with --head none)")
    init.add_argument("--dtype", default="float32", help="weights dtype on disk: float32 | bfloat16 (default float32)")
    init.add_argument("--copy-target-layers", action="store_true",
                      help="start the draft layers as copies of the target's last layers instead of random")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    init.add_argument("--draft-vocab-size", type=int, default=0, metavar="K",
                      help="draft over the K most frequent response tokens of --vocab-data only (EAGLE-3's d2t "
                      "mapping; the LM head and Markov W2 then cost K / V of the full ones); 0 = the full "
                      "vocabulary (default)")
    init.add_argument("--vocab-data", default=None, metavar="JSONL",
                      help="regenerated training data (`dspark data regenerate`) that ranks the tokens for "
                      "--draft-vocab-size")
    init.set_defaults(func=cmd_draft_init)
    exp = dsub.add_parser(
        "export",
        help="copy a drafter for vLLM / DeepSpec, speculators, or llama.cpp (GGUF)",
        description="Copy a drafter checkpoint for other tools. --layout deepspec (default): DeepSpec's own "
        "layout (`Qwen3DSparkModel`, `model_type: qwen3`, the tensors plus copies of the target's "
        "`embed_tokens.weight` and `lm_head.weight`, the K draft rows of it for a reduced vocabulary), which vLLM "
        "and DeepSpec load. --layout speculators: the `speculators` package's DSpark layout (the target's "
        "embedding and LM head are read back from the target directory it names). --layout gguf: one GGUF file "
        "that llama.cpp runs as a DSpark draft (`llama-server -m TARGET.gguf -md OUT --spec-type draft-dspark`), "
        "the tokenizer copied from the target's GGUF (--model, default the embedded SmolLM2). dspark loads "
        "DeepSpec-layout checkpoints as they are.",
    )
    exp.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    exp.add_argument("--out", required=True, help="output directory (a .gguf file for --layout gguf)")
    exp.add_argument("--layout", default="deepspec", choices=["deepspec", "speculators", "gguf"],
                     help="checkpoint layout to write (default deepspec)")
    exp.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                     help="--layout gguf: the matrices' type (default: the checkpoint's)")
    target_args(exp, dtype=False)
    exp.set_defaults(func=cmd_draft_export)
    conv = dsub.add_parser(
        "convert",
        help="copy a drafter with its weights in another dtype",
        description="Copy a drafter checkpoint with its weights stored in --dtype (bfloat16 halves the size); "
        "config and calibration temperatures are kept. Loading casts to the target's dtype either way.",
    )
    conv.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument("--dtype", required=True, choices=["float32", "bfloat16"], help="weights dtype on disk")
    target_args(conv, dtype=False)
    conv.set_defaults(func=cmd_draft_convert)


def _tap_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DsparkError(f"--tap-layers expects comma-separated integers, got {text!r}") from None


def _fp32_target(args):
    """The target as drafter tools need it: fp32, unpacked weights, tokenizer optional."""
    import torch

    return open_target(args, dtype=torch.float32, pack=False, require_tokenizer=False)


def cmd_draft_init(args) -> int:
    import torch

    from dspark.draft.checkpoint import init_from_target, new_draft_config, save_drafter
    from dspark.draft.dspark import DSparkModel
    from dspark.draft.vocab import coverage, most_frequent
    from dspark.model.loading import parse_dtype
    from dspark.train.data import load_samples

    dtype = parse_dtype(args.dtype, quantised=False)
    head = "vanilla" if args.head == "markov" else args.head
    confidence = args.confidence_head if args.confidence_head is not None else head != "none"
    taps = _tap_layers(args.tap_layers)
    if args.draft_vocab_size < 0:
        raise DsparkError(f"--draft-vocab-size must be >= 0, got {args.draft_vocab_size}")
    if bool(args.draft_vocab_size) != bool(args.vocab_data):
        raise DsparkError("--draft-vocab-size and --vocab-data go together: the data's response tokens pick the "
                          "draft vocabulary")
    check_writable(args.out)
    samples = load_samples(args.vocab_data) if args.vocab_data else None
    target = _fp32_target(args)
    cfg = new_draft_config(
        target,
        block_size=args.block_size,
        num_hidden_layers=args.layers,
        target_layer_ids=taps,
        markov_head_type=head,
        markov_rank=args.markov_rank,
        enable_confidence_head=confidence,
        mask_token_id=args.mask_token_id,
        draft_vocab_size=args.draft_vocab_size,
        context_fusion=args.context_fusion,
    )
    torch.manual_seed(args.seed)
    model = DSparkModel(cfg)
    init_from_target(model, target, copy_layers=args.copy_target_layers)
    if samples is not None:
        replies = [s.response_ids for s in samples]
        model.set_draft_vocab(most_frequent(replies, args.draft_vocab_size, target.cfg.vocab_size))
        print(f"draft vocabulary: {args.draft_vocab_size} of {target.cfg.vocab_size} tokens, covering "
              f"{coverage(replies, model.draft_ids):.1%} of the response tokens of {args.vocab_data}")
    out = save_drafter(model, args.out, target=target, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {cfg.to_dict()['architectures'][0]}, head {head}, block {cfg.block_size}, "
          f"{cfg.num_hidden_layers} layer(s), taps {cfg.target_layer_ids}, mask token {cfg.mask_token_id}, "
          f"{n_params / 1e6:.2f}M parameters")
    return 0


def cmd_draft_export(args) -> int:
    if args.layout == "gguf":
        return _export_gguf(args)
    if args.dtype:
        raise DsparkError("--dtype applies to --layout gguf; `dspark draft convert` changes a checkpoint's dtype")
    from dspark.draft.export import export_drafter

    check_writable(args.out)
    target = _fp32_target(args)
    out = export_drafter(args.drafter, target, args.out, args.layout)
    print(f"wrote {out} ({args.layout} layout)")
    return 0


def _export_gguf(args) -> int:
    import torch

    from dspark.draft.export_gguf import export_gguf, p_min_table
    from dspark.model.loading import gguf_file_of

    tokenizer = gguf_file_of(args.model)
    if tokenizer is None:
        raise DsparkError(f"--layout gguf copies the target's tokenizer from its GGUF file, and {args.model} is an "
                          "HF directory: pass --model TARGET.gguf (llama.cpp's convert_hf_to_gguf.py makes one), "
                          "or export --layout deepspec and convert that with convert_hf_to_gguf.py "
                          "--target-model-dir TARGET_DIR")
    if not args.out.endswith(".gguf"):
        raise DsparkError(f"--layout gguf writes one file: give --out a name ending in .gguf, got {args.out!r}")
    check_writable(args.out, kind="file")
    target = _fp32_target(args)
    done = export_gguf(args.drafter, target, tokenizer, args.out, getattr(torch, args.dtype) if args.dtype else None)
    print(f"wrote {done.path}: {done.tensors} tensors, llama.cpp's `dflash` architecture; run it with\n"
          f"  llama-server -m {tokenizer} -md {done.path} --spec-type {done.spec_type}")
    if done.temperatures:
        print("--spec-draft-p-min thresholds each slot's raw confidence σ(z_k) (0, its default, ignores the head); "
              "dspark's calibrated confidence σ(z_k / T_k) >= c is raw >= (per block position):")
        for c, raw in p_min_table(done.temperatures):
            print(f"  c = {c}: " + " ".join(f"{x:.2f}" for x in raw))
    return 0


def cmd_draft_convert(args) -> int:

    from dspark.draft.checkpoint import convert_drafter
    from dspark.model.loading import parse_dtype

    check_writable(args.out)
    target = _fp32_target(args)
    out = convert_drafter(args.drafter, target, args.out, parse_dtype(args.dtype, quantised=False))
    print(f"wrote {out} ({args.dtype})")
    return 0
