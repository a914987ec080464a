"""A clean stop on request: SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's timeout) during training
lets the current step finish, checkpoints every run at that step and returns; a second signal stops
at once (the last periodic checkpoint stays). A run of several drafters then holds checkpoints of
one step, which a hard kill between their saves could not promise."""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self, world: int = 1, device: torch.device | str = "cpu"):
        self.world, self.device = world, device
        self.signalled = False
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        print(f"\n[dspark] {signal.Signals(signum).name}: stopping after this step with a checkpoint "
              "(signal again to stop at once)", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """Whether to stop now; under torchrun every rank stops at the same step if any was signalled."""
        if self.world == 1:
            return self.signalled
        flag = torch.tensor([int(self.signalled)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
