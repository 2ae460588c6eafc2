"""`magicdec serve` end to end: the official openai client against a live server on 127.0.0.1.

One server subprocess per module (the default model, 4 slots x 1024 tokens, self-speculation on, an API
key), idle at the start of every test that uses it; tests that stop a server start their own. Failure injection (a failing step, a dead engine thread, a
full queue, a model without a chat template) uses small servers in this process, over the test's own
engine. Every wait is bounded; outputs are checked against offline plain decoding of each prompt alone.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from magicdec.sampling import SamplingParams  # noqa: E402
from magicdec.server.metrics import ServerMetrics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "test-key"
MAX_LEN = 1024
STARTUP_S = 120  # loading the model on a busy 2-core machine
WAIT_S = 20  # any other wait for the server to settle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def http_json(url: str, body: bytes | dict | None = None, key: str | None = KEY) -> tuple[int, dict | str]:
    """(status, parsed JSON body or text) of a GET (body None) or a POST."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on /metrics whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def assert_envelope(body: dict, status: int) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]


@dataclass
class Server:
    base: str  # http://127.0.0.1:port
    proc: subprocess.Popen
    log: Path

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=kw.pop("api_key", KEY), max_retries=0,
                             timeout=120, **kw)


KV_CACHE_GB = 0.25


@contextmanager
def serve(log: Path, *args: str) -> Iterator[Server]:
    """`magicdec serve` with `args` on a free port of 127.0.0.1, healthy; killed at the end if still running."""
    port = free_port()
    cmd = [sys.executable, "-m", "magicdec", "serve", "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return http_json(f"{srv.base}/health")[0] == 200
        except OSError:
            return False

    try:
        wait_until(healthy, STARTUP_S, "the server's /health")
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory) -> Iterator[Server]:
    """The module's server: 4 slots x MAX_LEN tokens, self-speculation, an API key, a small KV cache."""
    with serve(tmp_path_factory.mktemp("serve") / "server.log", "--max-running", "4", "--max-model-len",
               str(MAX_LEN), "--draft", "self-streaming", "--budget", "64", "--gamma", "3", "--api-key", KEY,
               "--dtype", "fp32",  # fp32: the offline reference's dtype
               "--kv-cache-gb", str(KV_CACHE_GB)) as srv:
        yield srv


@pytest.fixture
def server(shared_server) -> Server:
    """The module's server, idle: a test starts with no request of another's still running or waiting (a client that
    walked away is aborted by the server a moment later)."""
    wait_until(lambda: _idle(shared_server), WAIT_S, "the server to be idle")
    return shared_server


@pytest.fixture(scope="module")
def model_name(shared_server) -> str:
    return shared_server.client().models.list().data[0].id


@pytest.fixture(scope="module")
def offline(llm) -> Callable[..., str]:
    """offline(prompt text or ids, max_tokens, **params) -> the text of plain decoding of that prompt alone."""

    def run(prompt: str | list[int], max_tokens: int, **params) -> str:
        kw = {"prompt_token_ids": [prompt]} if isinstance(prompt, list) else {"prompts": [prompt]}
        return llm.generate(params=SamplingParams(max_tokens=max_tokens, **params), **kw)[0].text

    return run


PROMPT = "The old lighthouse keeper climbed the stairs and"


# --- the basics ---------------------------------------------------------------------------------------------
def test_ready_line_models_and_health(server, model_name):
    assert "ready on http://127.0.0.1" in server.log.read_text()
    assert model_name == "SmolLM2-135M-Instruct"
    status, body = http_json(f"{server.base}/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == MAX_LEN
    assert http_json(f"{server.base}/health")[0] == 200


def test_completion_greedy_equals_offline_with_usage(server, model_name, offline, llm):
    out = server.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == offline(PROMPT, 12, temperature=0)
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
           (prompt_tokens, 12, prompt_tokens + 12)


def test_streaming_adds_up_to_the_completion_and_reports_usage(server, model_name, offline):
    stream = server.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == offline(PROMPT, 12, temperature=0)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(server, model_name):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": model_name, "prompt": PROMPT, "max_tokens": 3,
                                                        "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_template_renders_like_transformers(server, model_name, llm, hf_tokenizer, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    status, tok = http_json(f"{server.base}/tokenize", {"messages": messages})
    assert status == 200 and tok["tokens"] == llm.tokenizer.tok.encode(want, add_special_tokens=False).ids
    out = server.client().chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline(tok["tokens"], 10, temperature=0)
    assert out.usage.prompt_tokens == tok["count"]


def test_second_chat_turn_is_served_from_the_prefix_cache_like_a_cold_prefill(server, model_name, corpus_prompt,
                                                                              llm, offline):
    """Turn 2 of a conversation re-sends turn 1 (a 400-token excerpt) and its reply: the response reports the history
    as cached tokens, /metrics counts the hit, and the text equals plain decoding of the same prompt cold."""
    hits = metric(server.base, "magicdec:prefix_cache_hits_total", model_name=model_name)
    client = server.client()
    messages = [{"role": "user", "content": "Summarise: " + llm.tokenizer.decode(corpus_prompt(400, book=2))}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now say it again, shorter, in one line please, and nothing else at all."}]
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 64 <= cached < second.usage.prompt_tokens
    assert metric(server.base, "magicdec:prefix_cache_hits_total", model_name=model_name) - hits >= cached
    status, tok = http_json(f"{server.base}/tokenize", {"messages": messages})
    assert status == 200 and second.choices[0].message.content == offline(tok["tokens"], 16, temperature=0)


def test_chat_streaming(server, model_name):
    client = server.client()
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_tokenize_and_detokenize(server, llm):
    status, tok = http_json(f"{server.base}/tokenize", {"prompt": PROMPT})
    assert status == 200 and tok["tokens"] == llm.tokenizer.encode(PROMPT) and tok["max_model_len"] == MAX_LEN
    status, text = http_json(f"{server.base}/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and text["prompt"] == PROMPT


def test_stop_string_cuts_the_text_streamed_or_not(server, model_name, offline):
    free = offline(PROMPT, 16, temperature=0, ignore_eos=True)
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # three characters from the middle
    assert stop.strip(), f"pick another stop from {free!r}"
    want = free[: free.index(stop)]
    client = server.client()
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n_takes_consecutive_seeds(server, model_name):
    client = server.client()

    def sample(seed: int, n: int = 1) -> list[str]:
        out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0.9,
                                        top_p=0.95, seed=seed, n=n, extra_body={"top_k": 50})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert sample(7, n=2) == first + sample(8)


# --- errors -------------------------------------------------------------------------------------------------
def test_error_codes(server, model_name):
    client = server.client()
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    bad = [dict(temperature=-1), dict(top_p=2.0), dict(max_tokens=0), dict(n=0), dict(logprobs=99),
           dict(extra_body={"top_k": -5}), dict(prompt=[7] * (MAX_LEN + 10)), dict(prompt=""),
           dict(max_tokens=MAX_LEN), dict(prompt=[10**7])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": model_name, "prompt": PROMPT, "max_tokens": 2, **kw})
        assert e.value.status_code == 400, kw
        assert_envelope(e.value.body if "error" in e.value.body else {"error": e.value.body}, 400)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    url = f"{server.base}/v1/completions"
    for body in (b"{not json", b"[1, 2]", json.dumps({"model": model_name}).encode(),
                 json.dumps({"prompt": PROMPT, "max_tokens": "many"}).encode()):
        status, reply = http_json(url, body)
        assert status == 400, body
        assert_envelope(reply, 400)
    status, reply = http_json(url, {"prompt": PROMPT}, key=None)
    assert status == 401 and reply["error"]["type"] == "authentication_error"
    status, reply = http_json(f"{server.base}/v1/nothing-here", {"prompt": PROMPT})
    assert status == 404
    assert_envelope(reply, 404)
    assert http_json(f"{server.base}/health")[0] == 200


# --- disconnects ------------------------------------------------------------------------------------------
def _aborts(server: Server) -> float:
    return metric(server.base, "magicdec:request_success_total", finished_reason="abort")


def _idle(server: Server) -> bool:
    return metric(server.base, "magicdec:num_requests_running") == 0 == metric(server.base, "magicdec:num_requests_waiting")


def _open(server: Server, model_name: str, stream: bool) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    return conn


def test_disconnect_mid_stream_frees_the_slot(server, model_name):
    aborts = _aborts(server)
    conn = _open(server, model_name, stream=True)
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")  # it is generating
    assert metric(server.base, "magicdec:num_requests_running") == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: _idle(server), WAIT_S, "the slot to be freed")
    assert _aborts(server) == aborts + 1


def test_disconnect_while_waiting_for_a_whole_completion_frees_the_slot(server, model_name):
    aborts = _aborts(server)
    conn = _open(server, model_name, stream=False)
    wait_until(lambda: metric(server.base, "magicdec:num_requests_running") == 1, WAIT_S, "the request to run")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: _idle(server), WAIT_S, "the slot to be freed")
    assert _aborts(server) == aborts + 1


# --- arrivals over time, with speculation -------------------------------------------------------------------
def test_staggered_arrivals_with_speculation_equal_offline_decoding(server, model_name, corpus_prompt, offline):
    prompts = [corpus_prompt(n, book=b, at=0.5) for n, b in ((600, 1), (90, 2), (300, 3), (40, 4), (200, 5))]
    client = server.client()

    def greedy(i: int) -> str:
        time.sleep(0.4 * i)  # later ones arrive while earlier ones prefill or decode
        out = client.completions.create(model=model_name, prompt=prompts[i], max_tokens=12, temperature=0)
        return out.choices[0].text

    def sampled() -> str:
        out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=123)
        return out.choices[0].text

    drafts = metric(server.base, "magicdec:spec_decode_num_drafts_total")
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        crowd = pool.submit(lambda: (time.sleep(0.6), sampled())[1])
        texts = list(pool.map(greedy, range(len(prompts)), timeout=120))
        in_crowd = crowd.result(timeout=120)
    assert texts == [offline(p, 12, temperature=0) for p in prompts]
    assert in_crowd == sampled()  # alone now
    assert metric(server.base, "magicdec:spec_decode_num_drafts_total") > drafts  # it did speculate


# --- load ---------------------------------------------------------------------------------------------------
def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_load_every_request_answered_once_and_the_server_returns_to_idle(server, model_name, corpus_prompt):
    n_requests, n_clients = 32, 8
    prompts = [corpus_prompt(20 + 37 * (i % 7), book=i % 5, at=0.3) for i in range(n_requests)]
    cancel = {i for i in range(n_requests) if i % 5 == 3}
    server.client().completions.create(model=model_name, prompt=prompts[0], max_tokens=2)  # warm, when run alone
    rss_idle = _rss_bytes(server.proc.pid)
    local = threading.local()

    def one(i: int) -> tuple[int, str, int]:
        if not hasattr(local, "client"):
            local.client = server.client()
        max_tokens = 2 + i % 9
        if i in cancel:  # read one chunk, then walk away
            stream = local.client.completions.create(model=model_name, prompt=prompts[i], max_tokens=64,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()
            return i, "cancelled", 0
        out = local.client.completions.create(model=model_name, prompt=prompts[i], max_tokens=max_tokens,
                                              temperature=0.7, seed=i)
        assert len(out.choices) == 1 and out.usage.completion_tokens <= max_tokens
        return i, out.choices[0].finish_reason, out.usage.completion_tokens

    with ThreadPoolExecutor(n_clients) as pool:
        results = list(pool.map(one, range(n_requests), timeout=180))
    assert sorted(i for i, _, _ in results) == list(range(n_requests))  # each answered exactly once
    assert all(reason in ("stop", "length") and tokens > 0 for i, reason, tokens in results if i not in cancel)
    wait_until(lambda: _idle(server), WAIT_S, "running and waiting to return to 0")
    assert metric(server.base, "magicdec:kv_cache_usage_perc") == 0
    # the KV blocks are touched as requests use them: no growth but theirs, bounded by --kv-cache-gb
    assert _rss_bytes(server.proc.pid) < rss_idle + 64 * 2**20 + KV_CACHE_GB * 2**30


def test_sigterm_shuts_down_cleanly(tmp_path):
    """A server of its own (the others' stays up), stopped mid-stream: the stream ends, the process exits, and the
    log says so without a traceback."""
    with serve(tmp_path / "server.log", "--max-running", "1", "--max-model-len", "256", "--draft", "none") as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                                                            "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")  # it is generating
        srv.proc.send_signal(signal.SIGTERM)
        try:  # the stream ends: complete, or cut when the shutdown's grace period runs out
            response.read()
        except http.client.IncompleteRead:
            pass
        conn.close()
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after shutting down
    log = srv.log.read_text()
    assert log.rstrip().endswith("magicdec serve: stopped") and "Traceback" not in log


def test_default_draft_auto_serves_plain_decodings_tokens(tmp_path, offline, corpus_prompt, kv_bound_profile):
    """`serve` with no --draft plans with `--draft auto` (here on a profile where drafting pays, so that no test times
    the machine): it drafts, re-planning each step, and a greedy and a seeded sampled request get plain decoding's
    tokens."""
    with serve(tmp_path / "server.log", "--max-running", "2", "--max-model-len", str(MAX_LEN), "--dtype", "fp32",
               "--hardware", kv_bound_profile) as srv:
        assert "draft auto: self-" in srv.log.read_text()
        client, prompt = srv.client(api_key="-"), corpus_prompt(800, book=6)
        greedy = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0)
        sampled = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16,
                                            temperature=0.8, seed=5)
        assert greedy.choices[0].text == offline(prompt, 16, temperature=0)
        assert sampled.choices[0].text == offline(prompt, 16, temperature=0.8, seed=5)
        assert metric(srv.base, "magicdec:spec_decode_num_drafts_total") > 0


def test_serve_refuses_what_does_not_fit_in_one_line():
    cmd = [sys.executable, "-m", "magicdec", "serve", "--max-running", "100000", "--max-model-len", "8k", "--port",
           str(free_port()), "--draft", "none"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=STARTUP_S, env=env, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("magicdec: error: 100000 slots of up to") and done.stderr.count("\n") == 1
    assert "--max-running" in done.stderr


# --- failure injection, in this process -------------------------------------------------------------------
@contextmanager
def local_server(llm, *, slots: int = 1, max_queued: int | None = None, chat_template: str | None = None,
                 engine_hook: Callable | None = None) -> Iterator[tuple[str, object]]:
    """An app over a small engine of the test's LLM, served by uvicorn on a thread: (base URL, LLMEngine). The engine
    is dropped afterwards, so that no later user of `llm` gets one that `engine_hook` changed."""
    from magicdec.server.app import build_app
    from magicdec.server.async_engine import AsyncEngine
    from magicdec.server.metrics import ServerMetrics

    engine = llm.engine(max_num_seqs=slots, max_model_len=256, max_queued=max_queued)
    if engine_hook is not None:
        engine_hook(engine)
    metrics = ServerMetrics("local", "none", None)
    app = build_app(AsyncEngine(engine, metrics), llm.tokenizer, metrics, model_name="local", model_root="-",
                    chat_template=chat_template)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, WAIT_S, "the local server")
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        llm.free_engine()  # the hooked engine is not the LLM's to reuse


def test_failing_step_fails_its_requests_and_the_server_stays_up(llm):
    failures = []

    def fail_once(engine) -> None:
        execute = engine.runner.execute

        def flaky(step):
            if not failures:
                failures.append(step)
                raise RuntimeError("injected device fault")
            return execute(step)

        engine.runner.execute = flaky

    with local_server(llm, engine_hook=fail_once) as (base, _):
        status, body = http_json(f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert status == 500 and "injected device fault" in body["error"]["message"]
        status, body = http_json(f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert http_json(f"{base}/health")[0] == 200


def test_dead_engine_thread_answers_503(llm):
    def die(engine) -> None:
        def broken() -> bool:
            raise RuntimeError("engine loop bug")

        engine.has_unfinished = broken

    with local_server(llm, engine_hook=die) as (base, _):
        status, body = http_json(f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and "engine loop bug" in body["error"]["message"]
        status, body = http_json(f"{base}/health")
        assert status == 503
        assert_envelope(body, 503)


def test_full_queue_answers_429(llm):
    with local_server(llm, slots=1, max_queued=1) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        running = client.completions.create(model="local", prompt=PROMPT, max_tokens=200, stream=True,
                                            extra_body={"ignore_eos": True})
        next(iter(running))  # holds the only slot
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.completions.create, model="local", prompt=PROMPT, max_tokens=2)
            wait_until(lambda: metric(base, "magicdec:num_requests_waiting") == 1, WAIT_S, "a queued request")
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="local", prompt=PROMPT, max_tokens=2)
            assert e.value.status_code == 429
            running.close()  # frees the slot for the queued one
            assert queued.result(timeout=60).choices[0].finish_reason in ("stop", "length")


def test_chat_without_a_template_is_a_400(llm):
    with local_server(llm) as (base, _):
        status, body = http_json(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "no chat template" in body["error"]["message"]


# --- streaming text ---------------------------------------------------------------------------------------
def test_detokenizer_holds_back_partial_characters_and_stop_prefixes(llm):
    from magicdec.server.detokenize import IncrementalDetokenizer

    tok = llm.tokenizer
    text = "Voilà 日本語 text, then STOP here"
    ids = tok.tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    deltas = [detok.push([i]) for i in ids]
    emitted = "".join(deltas)
    assert "\ufffd" not in emitted and emitted == "Voilà 日本語 text, then "
    assert detok.finish("Voilà 日本語 text, then ") == ""
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    partial = "".join(detok.push([i]) for i in tok.tok.encode("and ST", add_special_tokens=False).ids)
    assert partial == "and "  # "ST" may still become the stop string
    assert partial + detok.finish("and ST") == "and ST"  # it did not: the request ended by length


def test_prefill_and_decode_seconds_count_the_engine_step_times(llm):
    """magicdec:prefill_seconds / decode_seconds follow the engine's own prefill_s / decode_s, step by step, over a
    real engine prefilling in chunks and decoding."""
    engine = llm.engine(max_num_seqs=2, max_model_len=256, prefill_chunk=32)
    engine.reset_stats()
    metrics = ServerMetrics("m", "none", None)

    def seconds(phase: str) -> float:
        return metrics.registry.get_sample_value(f"magicdec:{phase}_seconds_total", {"model_name": "m"})

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    requests = [engine.add_request(f"r{i}", llm.tokenizer.encode(PROMPT * (2 + i)), params) for i in range(2)]
    seen = []
    for _ in range(64):
        if not engine.has_unfinished():
            break
        changed = engine.step()
        metrics.observe_step(engine, [(r, len(r.output_ids)) for r in changed])
        stats = engine.stats
        assert (seconds("prefill"), seconds("decode")) == pytest.approx((stats.prefill_s, stats.decode_s), abs=1e-9)
        seen.append((stats.prefill_s, stats.decode_s))
    assert all(r.finished for r in requests)
    assert seen[-1][0] > 0 and seen[-1][1] > 0
    assert seen == sorted(seen)  # both only grow
