"""What every command shares: the one-line-error parser, argument types, the target arguments."""

from __future__ import annotations

import argparse

from dspark.schedule.policies import POLICIES  # noqa: F401 (the spellings every command's --policy takes)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def command_group(sub, name: str, help: str, description: str):
    """A command with actions (`dspark NAME ACTION ...`); returns what its actions are added to."""
    group = sub.add_parser(name, help=help, description=description)
    actions = group.add_subparsers(dest=f"{name}_command", metavar="ACTION", parser_class=Parser)
    actions.required = True
    return actions


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def target_args(p: argparse.ArgumentParser, dtype: bool = True, threads: bool = False) -> None:
    """--model / --dtype / --threads, the same on every subcommand that loads the target."""
    p.add_argument("--model", default=None, help="target: HF model directory or .gguf file (default: embedded SmolLM2)")
    if dtype:
        p.add_argument("--dtype", default="auto", help=(
            "float32 | bfloat16 | q4 | q4f32 | q4q8 | int8 | auto (default). auto: bfloat16 on CPUs with bf16 "
            "matrix units (AMX / AVX512-BF16) and on GPUs; elsewhere q4q8 for a GGUF of Q4 / Q8_0 blocks (q4f32 "
            "where its kernel does not build), else float32. q4: a GGUF file's Q4_0 / Q4_1 weights run as stored "
            "by int4 kernels, bf16 activations (CPU): fast plain decoding, but multi-token verification costs "
            "more. q4f32: the GGUF's blocks as stored with fp32 activations (CPU; float32's weights at the "
            "file's bytes). q4q8: the same blocks times activations quantised to 8 bits as llama.cpp does (AVX2 "
            "CPU; faster, llama.cpp's numerics). Speculation is token-identical to plain decoding in both. "
            "int8: the compiled runner with int8 weight-only projections (build it with `dspark compile "
            "--dtype int8`)"))
        p.add_argument("--runner", default="auto", choices=("auto", "compiled", "eager"), help=(
            "auto (default): the compiled bf16 runner where `dspark compile` has built one for this model, "
            "CPU and thread count (faster, and speculative output token-identical to plain at T = 0), else "
            "eager PyTorch. compiled: fail without one. eager: never use it"))
    if threads:
        p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")


def open_target(args, **kwargs):
    """Load the target that --model / --dtype / --threads name (kwargs go to `load_target`)."""
    import torch

    from dspark.model.loading import load_target, parse_dtype

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if "dtype" not in kwargs:
        kwargs["dtype"] = parse_dtype(args.dtype, spec=args.model)
    if "runner" not in kwargs and hasattr(args, "runner"):
        kwargs["runner"] = args.runner
    return load_target(args.model, **kwargs)
