"""`dspark serve`: a real server process on 127.0.0.1, called over real HTTP (the `openai` client and
raw sockets). Most tests use a tiny random Llama with SmolLM2's tokenizer (fast, never stops early);
the exactness test uses the embedded SmolLM2 and its shipped drafter."""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import assert_clean_error, eval_prompts, run_cli
from serving import VOCAB, WINDOW, Server, chat, open_stream, openai

from dspark.decode.streaming import TextStreamer


@pytest.fixture(scope="module")
def tiny_server(tiny_dirs):
    model_dir, drafter_dir = tiny_dirs
    server = Server("--model", str(model_dir), "--drafter", str(drafter_dir), "--policy", "full", "--dtype",
                    "float32", "--max-batch", "8", "--max-model-len", str(WINDOW), "--served-model-name", "tiny")
    yield server
    assert server.stop() == 0  # SIGTERM: a graceful shutdown


# ---- tests ---------------------------------------------------------------------------------------
def test_streamed_text_never_passes_a_stop_string():
    """The token that completes a stop string may carry text beyond it: none of it is written."""
    vocab = {1: "ab", 2: "c", 3: "XYz", 4: "tail"}
    out: list[str] = []
    streamer = TextStreamer(lambda ids: "".join(vocab[i] for i in ids), out.append, stop=["cXY"])
    for tok in (1, 2, 3, 4):
        streamer.push([tok])
    streamer.finish("abc")
    assert "".join(out) == "abc"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dspark", "default"])
def test_concurrent_streams_match_offline_greedy_on_smollm2(smollm2_fp32, policy):
    """8 concurrent streaming chat requests at T = 0, through the shipped drafter and the dspark policy
    (chains) or the default (auto+lookup@tree: every row's token tree with its prompt-lookup branch, in
    one ragged forward): each text is exactly what plain greedy decoding gives offline."""
    from dspark.decode.generate import Decoder

    prompts = eval_prompts("mt-bench", 3) + eval_prompts("gsm8k", 3) + eval_prompts("mbpp", 2)
    ar = Decoder(smollm2_fp32)
    want = [ar.generate(smollm2_fp32.encode_prompt(p), 48).text for p in prompts]
    server = Server("--dtype", "float32", "--max-batch", "8", "--max-model-len", "1024",
                    *(["--policy", policy] if policy != "default" else []), name="smollm2")
    try:
        client = server.client()

        def stream(prompt):
            chunks = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=48, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            parts, usage, finish, stats = [], None, None, None
            for c in chunks:
                if c.choices:
                    parts.append(c.choices[0].delta.content or "")
                    finish = c.choices[0].finish_reason or finish
                usage = c.usage or usage
                stats = (c.model_extra or {}).get("dspark") or stats
            return "".join(parts), usage, finish, stats

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, prompts))
        assert [text for text, _, _, _ in got] == want
        assert sum(stats["draft_tokens"] for _, _, _, stats in got) > 0  # speculation ran
        for (_, usage, finish, _), prompt in zip(got, prompts):
            assert usage.prompt_tokens == len(smollm2_fp32.encode_prompt(prompt))
            assert finish in ("stop", "length") and (finish == "stop") == (usage.completion_tokens < 48)
        # the chat template's system prompt (24 tokens) came from the prefix cache after the first prefill
        assert sum(usage.prompt_tokens_details.cached_tokens for _, usage, _, _ in got) >= 16 * (len(prompts) - 1)
    finally:
        assert server.stop() == 0


def test_seeded_sampling_is_reproducible(tiny_server):
    """Under a batch-independent policy (here `full`) a seed fixes the sample: alone or among other
    requests, streamed or whole."""
    client = tiny_server.client()

    def whole(seed):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a story."}],
                                           max_tokens=40, temperature=1.0, top_p=0.9, seed=seed,
                                           extra_body={"top_k": 50})
        return r.choices[0].message.content

    alone = whole(7)
    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(whole, [7, 8, 7, 9, 7, 10]))
    assert crowd[0] == crowd[2] == crowd[4] == alone
    assert len({alone, crowd[1], crowd[3], crowd[5]}) > 1  # other seeds, other samples
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a story."}],
                                            max_tokens=40, temperature=1.0, top_p=0.9, seed=7, stream=True,
                                            extra_body={"top_k": 50})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone


def test_stream_and_whole_agree_with_stop_strings(tiny_server):
    client = tiny_server.client()
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=60, temperature=0)
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 60
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=60, temperature=0,
                                      stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=60, temperature=0,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


@pytest.mark.parametrize("body, field", [
    ('{"model": "tiny", "messages": [', None),  # not JSON
    (chat("hi", temperature=-1), "temperature"),
    (chat("hi", top_p=2), "top_p"),
    (chat("hi", max_tokens=WINDOW), "max_tokens"),
    (chat("hi", max_completion_tokens=0), "max_completion_tokens"),
    (chat("hi", temperature="hot"), "temperature"),
    (chat("hi", n=2), "n"),
    (chat("hi", stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat("hi", logprobs=True), "logprobs"),
    (chat("hi", frobnicate=1), "frobnicate"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    (chat("word " * WINDOW), "messages"),
    (chat("hi", model="gpt-4"), "model"),
])
def test_malformed_requests_get_400_naming_the_field(tiny_server, body, field):
    status, reply, _ = tiny_server.post("/v1/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    assert ("JSON" if field is None else field) in error["message"]


def test_completions_validation_and_the_openai_client_errors(tiny_server):
    status, reply, _ = tiny_server.post("/v1/completions", {"model": "tiny", "prompt": [5, VOCAB]})
    assert status == 400 and reply["error"]["param"] == "prompt" and str(VOCAB) in reply["error"]["message"]
    status, reply, _ = tiny_server.post("/v1/completions", {"model": "tiny", "prompt": []})
    assert status == 400 and reply["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        tiny_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        tiny_server.client().completions.create(model="nope", prompt="x")
    assert tiny_server.get("/v1/nothing")[0] == 404
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_metrics_add_up_to_the_responses(tiny_server):
    client = tiny_server.client()
    before = tiny_server.wait_idle()

    def run(i):
        kw = dict(model="tiny", max_tokens=20 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
        if i % 3 == 0:
            r = client.completions.create(prompt=f"Count to {i}:", **kw)
            return r.usage, r.model_extra["dspark"]
        msgs = [{"role": "user", "content": f"Question {i}?"}]
        if i % 3 == 1:
            r = client.chat.completions.create(messages=msgs, **kw)
            return r.usage, r.model_extra["dspark"]
        usage = stats = None
        for c in client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                                **kw):
            usage = c.usage or usage
            stats = (c.model_extra or {}).get("dspark") or stats
        return usage, stats

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(9)))
    after = tiny_server.wait_idle()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usages, stats = [u for u, _ in results], [s for _, s in results]
    assert delta("dspark:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("dspark:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("dspark:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    hits = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert hits > 0 and delta("dspark:prefix_cache_hits_total") == hits  # the chat requests' system prompt
    assert sum(s["draft_tokens"] for s in stats) > 0
    assert delta("dspark:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in stats)
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == sum(s["accepted_tokens"] for s in stats)
    per_pos = sum(delta("dspark:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(4))
    assert per_pos == sum(s["accepted_tokens"] for s in stats)
    assert 0 < delta("dspark:spec_decode_num_drafts_total") <= sum(s["rounds"] for s in stats)
    finished = sum(delta("dspark:request_success_total", finished_reason=r) for r in ("stop", "length", "abort"))
    assert finished == delta("dspark:time_to_first_token_seconds_count") == delta(
        "dspark:e2e_request_latency_seconds_count") == 9
    assert delta("dspark:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    for u, s in zip(usages, stats):
        assert s["tau"] == pytest.approx((u.completion_tokens - 1) / s["rounds"])


def test_clients_that_disconnect_free_their_rows(tiny_server):
    """16 clients leave mid-stream (8 holding rows, 8 still queued) and 4 leave a whole request:
    nothing stays running or queued, no cache row stays held, and the next request is answered."""
    before = tiny_server.wait_idle()
    streams = []
    for i in range(16):
        sock, reader = open_stream(tiny_server, chat(f"Story {i}", max_tokens=3000, temperature=1.0, seed=i))
        assert reader.next_event()["choices"][0]["delta"]["role"] == "assistant"
        streams.append((sock, reader))
    for sock, reader in streams[:4]:  # some read tokens first
        reader.next_event()
    whole = []
    for i in range(4):
        c = tiny_server.connection()
        c.request("POST", "/v1/chat/completions", json.dumps(chat(f"Essay {i}", max_tokens=3000, seed=100 + i)),
                  {"Content-Type": "application/json"})
        whole.append(c)
    deadline = time.time() + 30
    while True:  # every request has reached the engine (a connection closed before is never run)
        m = tiny_server.metrics()
        if m[("dspark:num_requests_running", ())] + m[("dspark:num_requests_waiting", ())] == 20:
            break
        assert time.time() < deadline, m
        time.sleep(0.05)
    for sock, reader in streams:
        reader.file.close()
        sock.close()
    for c in whole:
        c.close()
    after = tiny_server.wait_idle()
    assert after[("dspark:kv_cache_usage_perc", ())] == 0
    aborted = after[("dspark:request_success_total", (("finished_reason", "abort"),))] - \
        before[("dspark:request_success_total", (("finished_reason", "abort"),))]
    assert aborted == 20, after
    r = tiny_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_full_queue_answers_429_and_shutdown_is_graceful(tiny_dirs):
    model_dir, _ = tiny_dirs
    server = Server("--model", str(model_dir), "--drafter", "none", "--dtype", "float32", "--max-batch", "1",
                    "--max-waiting", "1", "--max-model-len", str(WINDOW), "--served-model-name", "tiny",
                    "--shutdown-timeout", "600")  # room for A's 3,000 tokens on a slow, shared CPU
    try:
        running, reader = open_stream(server, chat("A", max_tokens=3000, temperature=1.0, seed=3))
        reader.next_event()
        reader.next_event()  # it holds the only row
        queued, queued_reader = open_stream(server, chat("B", max_tokens=20, temperature=0))
        queued_reader.next_event()  # the role chunk: it is in the queue
        status, reply, headers = server.post("/v1/chat/completions", chat("C", max_tokens=5))
        assert status == 429 and reply["error"]["code"] == "rate_limit_exceeded" and headers["retry-after"] == "1"
        assert server.metrics()[("dspark:request_rejected_total", (("reason", "queue_full"),))] == 1
        assert reader.next_event()["choices"][0]["finish_reason"] is None  # the first is still running
        # SIGTERM with both in flight: the server stops taking requests and finishes them first
        server.proc.send_signal(signal.SIGTERM)
        for r, limit in ((reader, 3000), (queued_reader, 20)):
            events = []
            while (e := r.next_event()) != "[DONE]":
                events.append(e)
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert server.proc.wait(60) == 0
        running.close()
        queued.close()
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_serve_rejects_bad_arguments_before_loading(tmp_path):
    assert_clean_error(run_cli("serve", "--port", "70000"), "--port")
    assert_clean_error(run_cli("serve", "--drafter", "/no/such/drafter"), "drafter")
    assert_clean_error(run_cli("serve", "--policy", "fastest"), "policy")
    assert_clean_error(run_cli("serve", "--prefix-cache-mib", "-1"), "--prefix-cache-mib")
    assert_clean_error(run_cli("serve", "--drafter", "/tmp@full", "--policy", "dspark"), "--policy")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert_clean_error(run_cli("serve", "--port", str(s.getsockname()[1])), "pick another")
