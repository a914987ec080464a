"""The dspark CLI with one fault injected into the engine, for the failure-isolation test: a request
whose prompt contains FAULT_MARK raises while its tokens are handled, after its first few."""

import sys

from dspark.cli import main
from dspark.decode import engine

FAULT_MARK = "INJECT-FAULT"
_emit = engine.Engine._emit


def _faulty_emit(self, slot, tokens):
    if FAULT_MARK in self.target.decode(slot.request.prompt_ids) and len(slot.checker.token_ids) >= 3:
        raise RuntimeError("injected fault")
    return _emit(self, slot, tokens)


if __name__ == "__main__":
    engine.Engine._emit = _faulty_emit
    sys.exit(main(sys.argv[1:]))
