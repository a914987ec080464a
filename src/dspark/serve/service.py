"""The server's engine loop: one thread owns the `Engine` and steps it while it has work; HTTP
handlers (on the asyncio loop, in another thread) submit and cancel through a thread-safe inbox that
is drained between steps, and receive their tokens as events on their own loop. Requests thus join
and leave the batch between engine steps, and a cancelled request frees its cache row before the
next one.

The loop runs in the thread that loaded the model (`dspark serve` runs it in the main thread and
uvicorn beside it): PyTorch's OpenMP pool belongs to the thread that first used it, and CPU
products from another thread ran ~2.5x slower on a 2-core machine (benchmarks/results/server.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from dspark.decode.engine import Engine, Request
from dspark.errors import DsparkError
from dspark.serve.metrics import ServerMetrics

log = logging.getLogger("dspark.serve")


class QueueFull(DsparkError):
    """The waiting queue is at its bound: answer 429."""


class EngineFailed(DsparkError):
    """The engine loop stopped on an error: answer 500 / 503."""


class RequestFailed(DsparkError):
    """One request failed in the engine (the others go on): answer 500."""


@dataclasses.dataclass(eq=False)
class Job:
    """A request as the server tracks it; `events` receives token-id lists, then None at the end
    (or a DsparkError: EngineFailed, or a request the engine refused)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float
    queued: bool = True  # counted in the waiting queue (until it takes a row, is cancelled or refused)
    rounds_seen: int = 0
    last_emit: float = 0.0

    def push(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed (server shutting down): nobody listens
            pass


class EngineService:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int):
        if max_waiting < 1:
            raise DsparkError(f"the waiting queue must hold at least 1 request, got {max_waiting}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet holding a row
        self._jobs: set[Job] = set()  # submitted and not finished
        self._step_tokens = 0
        self._stopping = False
        self._running = False
        self._closed = False  # set once the loop ends: nothing more is accepted
        self.error: str | None = None

    # ---- called from the HTTP side ---------------------------------------------------------
    def stop(self) -> None:
        """End the loop at the next step boundary, cancelling whatever is still queued or running."""
        self._stopping = True
        self._inbox.put(None)

    @property
    def alive(self) -> bool:
        return self._running and self.error is None

    def submit(self, request: Request) -> Job:
        """Queue `request` (raises QueueFull or EngineFailed); its events arrive on the calling loop."""
        loop = asyncio.get_running_loop()
        job = Job(request, loop, asyncio.Queue(), time.perf_counter())
        request.on_tokens = lambda ids: self._on_tokens(job, ids)
        request.on_finish = lambda r: self._on_finish(job)
        with self._lock:
            if self._closed or self.error is not None:
                raise self._stopped()
            if self._queued >= self.max_waiting:
                self.metrics.rejected("queue_full")
                raise QueueFull(f"the server's queue is full ({self.max_waiting} requests waiting); retry later")
            self._queued += 1
            self._jobs.add(job)
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """Drop `job` at the next step boundary (a no-op once it has finished)."""
        if not job.request.done:
            self._inbox.put(("cancel", job))

    # ---- the engine thread -------------------------------------------------------------------
    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Step the engine until `stop` (or until `keep_going()` turns false), then end every open job."""
        self._running = True
        try:
            while True:
                self._drain(block=not self.engine.has_work())
                if self._stopping or not keep_going():
                    break
                if self.engine.has_work():
                    self.engine.step()
                    self.metrics.verify_tokens.set(self._step_tokens)
                    self._step_tokens = 0
                self._publish()
        except Exception as e:  # a bug or an out-of-memory: fail every request, report unhealthy
            log.exception("engine loop failed")
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._running = False
            self._shutdown()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    kind, job = item
                    if kind == "submit":
                        self._admit(job)
                    else:
                        self.engine.cancel(job.request)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self, job: Job) -> None:
        try:
            self.engine.submit(job.request)
        except DsparkError as e:  # the handlers check limits first: this is a last line of defence
            self._leave_queue(job)
            with self._lock:
                self._jobs.discard(job)
            job.push(e)

    def _publish(self) -> None:
        e, m = self.engine, self.metrics
        active = e.active
        m.running.set(len(active))
        m.waiting.set(self._queued)
        m.kv_usage.set(sum(int(e.cache.lengths[b]) for b in active) / (e.max_batch * e.max_len))

    def _on_tokens(self, job: Job, ids: list[int]) -> None:
        now, m, r = time.perf_counter(), self.metrics, job.request
        if job.queued:  # its first token: the prompt is in its row
            self._leave_queue(job)
            m.prompt_tokens.inc(len(r.prompt_ids))
            m.prefix_cache_queries.inc(len(r.prompt_ids))
            m.prefix_cache_hits.inc(r.cached_tokens)
            m.ttft.observe(now - job.arrived)
        else:
            for _ in ids:
                m.itl.observe((now - job.last_emit) / len(ids))
        job.last_emit = now
        self._count_rounds(job)
        m.generation_tokens.inc(len(ids))
        job.push(ids)

    def _on_finish(self, job: Job) -> None:
        if job.queued:  # cancelled while waiting
            self._leave_queue(job)
        self._count_rounds(job)
        self.metrics.finished(job.request.finish_reason)
        self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        with self._lock:
            self._jobs.discard(job)
        error = job.request.error
        job.push(None if error is None else RequestFailed(f"the request failed in the engine ({type(error).__name__}: "
                                                          f"{error}); other requests are unaffected"))

    def _leave_queue(self, job: Job) -> None:
        job.queued = False
        with self._lock:
            self._queued -= 1

    def _stopped(self) -> EngineFailed:
        return EngineFailed(f"the engine stopped: {self.error or 'server shutting down'}")

    def _count_rounds(self, job: Job) -> None:
        for rnd in job.request.rounds[job.rounds_seen:]:
            self.metrics.count_round(rnd)
            self._step_tokens += 1 + rnd.verified
        job.rounds_seen = len(job.request.rounds)

    def _shutdown(self) -> None:
        """End every job still open: cancelled (on stop) or failed (on an engine error)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs)
        for job in jobs:
            if self.error is None and self.engine.cancel(job.request):
                continue  # on_finish pushed its end
            with self._lock:
                self._jobs.discard(job)
            job.push(self._stopped())
        try:
            self._publish()
        except Exception:
            pass
