"""Prometheus metrics of the server, named like vLLM's (`vllm:` -> `dspark:`).

One registry per server (not prometheus-client's global one), updated by the engine thread and
rendered by `GET /metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from dspark.decode.step import Round

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_drafts: int):
        disable_created_metrics()  # no `_created` series (as vLLM): they double every counter's output
        self.registry = CollectorRegistry()
        r, name = self.registry, ["model_name"]

        def counter(metric, doc, labels=()):
            return Counter(f"dspark:{metric}", doc, name + list(labels), registry=r)

        def gauge(metric, doc, labels=()):
            return Gauge(f"dspark:{metric}", doc, name + list(labels), registry=r)

        def histogram(metric, doc, buckets):
            return Histogram(f"dspark:{metric}", doc, name, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests holding a KV-cache row.").labels(model_name)
        self.waiting = gauge("num_requests_waiting", "Requests admitted to the queue, waiting for a row.")\
            .labels(model_name)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV-cache positions in use (0..1).")\
            .labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that took a row.").labels(model_name)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens of the requests that took a "
                                            "row, each looked up in the prefix cache where it is on.")\
            .labels(model_name)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                         "prefilled again).").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated (delivered to clients).")\
            .labels(model_name)
        self._success = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self._rejected = counter("request_rejected", "Requests refused before queueing, by reason.", ["reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)\
            .labels(model_name)
        self.itl = histogram("inter_token_latency_seconds",
                             "Seconds per output token after the first (a step's gap spread over the tokens it "
                             "delivered).", LATENCY_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)\
            .labels(model_name)
        self.num_drafts = counter("spec_decode_num_drafts", "Verification rounds with at least one draft token.")\
            .labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified by the target.")\
            .labels(model_name)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")\
            .labels(model_name)
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in "
                          "the block (0 = first draft).", ["position"])
        self.accepted_per_pos = [per_pos.labels(model_name, str(k)) for k in range(max_drafts)]
        self.verify_tokens = gauge("verify_tokens_per_step", "Tokens in the last verification forward "
                                   "(each running request's anchor plus the drafts chosen for it).").labels(model_name)
        self._sps = gauge("sps_profile_steps_per_second", "The profiled target steps/s per verification forward "
                          "of `tokens` tokens the DSpark policy schedules with.", ["tokens"])
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self._rejected.labels(model_name, "queue_full")

    def set_sps(self, values) -> None:
        for b, v in enumerate(values, 1):
            self._sps.labels(self.model_name, str(b)).set(v)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def count_round(self, rnd: Round) -> None:
        if rnd.verified:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(rnd.verified)
        if rnd.accepted:
            self.num_accepted_tokens.inc(rnd.accepted)
            for k in range(min(rnd.accepted, len(self.accepted_per_pos))):
                self.accepted_per_pos[k].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
