"""`magicdec serve` under hostile input: what cannot fit is refused for about what reading it costs, and nobody waits.

The longest token bounds how many characters a prompt that fits can have (checked on adversarial texts here); the
live server (its own subprocess, 1024-token context, a 64 MB body limit so that 40 MB prompts reach the character
check) refuses bodies over the limit with 413 and prompts that cannot fit with 400, before tokenizing them, while a
small request is served alongside; its resident memory stays near where it was. A second server (1 MB limit) shows
that a client that writes its whole body before reading, as urllib does, reads the 413 too. The streaming
detokenizer's cost does not grow with a stop string's length. Time bounds are generous: the server that tokenized
such prompts on its event loop took ~30 s a refusal, one after another.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from test_server import assert_envelope, http_json, serve
from magicdec.cli import main
from magicdec.loading import default_model_path
from magicdec.loading.gguf_file import gguf_metadata, read_gguf
from magicdec.loading.tokenizer import Tokenizer, tokenizer_from_gguf_fields
from magicdec.server.app import DRAIN_BYTES
from magicdec.server.detokenize import IncrementalDetokenizer

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
KEY = "limits-key"
MAX_LEN = 1024
LIMIT_MB = 64
STARTUP_S = 120  # loading the model on a busy 2-core machine
HUGE_CHARS = 40_000_000  # a 40 MB prompt: ~8M tokens, ~30 s to tokenize here
#: What a refusal, a small request among them or a streamed delta may take: a few times its worst on a loaded machine,
#: a fraction of the work the event loop did before (~30 s to tokenize a 40 MB prompt, ~10 s a delta against a stop
#: string of a million characters).
QUICK_S = 10
#: How much resident memory refused uploads may leave taken (a tokenized 40 MB prompt took 2.6-3.5 GB).
RSS_SLACK_MB = 500
CANNOT_FIT = f"more than the context of {MAX_LEN} tokens can hold"


# --- the longest token ------------------------------------------------------------------------------------
ADVERSARIAL = [" " * 5000, "\n" + " " * 5000, "#" * 5000, "=" * 3000 + "-" * 3000, "\t" * 4000, "\n" * 4000,
               "日本語のテキスト" * 500, "🙂" * 2000, "\x00\x01\x7f" * 1000, "1234567890" * 500, "<|im_start|>" * 300,
               "a" * 5000, " a" * 3000, "supercalifragilistic" * 300]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    """The default model's tokenizer, from its GGUF metadata (the weights are not loaded)."""
    meta = gguf_metadata(read_gguf(default_model_path()))
    return Tokenizer(tokenizer_from_gguf_fields(meta), meta.get("tokenizer.ggml.bos_token_id"), [], add_bos=True)


def test_no_text_has_more_characters_than_its_tokens_times_the_longest(smollm2):
    assert smollm2.max_token_chars == 81  # "\n" and 80 spaces
    for text in ADVERSARIAL:
        ids = smollm2.encode(text, add_bos=False)
        assert len(text) <= len(ids) * smollm2.max_token_chars, text[:20]


def _bpe(**steps) -> HFTokenizer:
    tok = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    for name, step in steps.items():
        setattr(tok, name, step)
    return tok


@pytest.mark.parametrize("steps", [dict(normalizer=normalizers.Strip()), dict(normalizer=normalizers.NFC()),
                                   dict(normalizer=normalizers.Replace("  ", " ")),
                                   dict(pre_tokenizer=pre_tokenizers.Whitespace()),
                                   dict(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed"))])
def test_no_bound_where_the_tokenizer_drops_or_merges_text(steps):
    assert Tokenizer(_bpe(**steps), None, [], add_bos=False).max_token_chars is None


def test_no_bound_where_tokens_swallow_spaces_or_unknown_runs():
    tok = _bpe()
    tok.add_tokens([AddedToken("<x>", lstrip=True)])
    assert Tokenizer(tok, None, [], add_bos=False).max_token_chars is None
    fused = HFTokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert Tokenizer(fused, None, [], add_bos=False).max_token_chars is None
    kept = _bpe(normalizer=normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "__")]))
    assert Tokenizer(kept, None, [], add_bos=False).max_token_chars == 2


def test_a_long_stop_string_costs_the_streaming_detokenizer_what_the_text_costs(smollm2):
    # each push held the text back against every prefix of the stop string: a million slices of up to a million
    # characters
    detok = IncrementalDetokenizer(smollm2, stop=("y" * 1_000_000, "and S"))
    start = time.monotonic()
    streamed = "".join(detok.push([i]) for i in smollm2.encode("The sea and sand", add_bos=False))
    assert time.monotonic() - start < QUICK_S
    assert streamed == "The sea and s"  # "and" may still become "and S"
    assert streamed + detok.finish("The sea and sand") == "The sea and sand"


@pytest.mark.parametrize("value", ["0", "-1", "x", "inf", "nan", "1e-9"])
def test_max_request_mb_must_be_a_size(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-request-mb", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("magicdec: error: argument --max-request-mb:") and err.count("\n") == 1


# --- the live server ----------------------------------------------------------------------------------------
@dataclass
class Server:
    port: int
    proc: subprocess.Popen

    def post(self, path: str, body: bytes | Iterator[bytes], key: str | None = KEY) -> tuple[int, dict, float]:
        """(status, JSON answer, seconds) of a raw POST; a generator body goes chunked, without Content-Length."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        start = time.monotonic()
        try:
            conn.request("POST", path, body, headers, encode_chunked=not isinstance(body, bytes))
            response = conn.getresponse()
            return response.status, json.loads(response.read()), time.monotonic() - start
        finally:
            conn.close()

    def rss_mb(self) -> float:
        """The server's resident memory (VmRSS)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=120)

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve-limits") / "server.log"
    cmd = [sys.executable, "-m", "magicdec", "serve", "--port", str(port), "--max-running", "4", "--max-model-len",
           str(MAX_LEN), "--draft", "none", "--max-request-mb", str(LIMIT_MB), "--api-key", KEY,
           "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    srv = Server(port, proc)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not srv.healthy():
            assert time.monotonic() < deadline, f"no /health after {STARTUP_S} s:\n{log.read_text()}"
            time.sleep(0.2)
        yield srv
        assert "Traceback" not in log.read_text()  # no refusal logged an exception
    finally:
        proc.kill()
        proc.wait(10)


def completion(prompt: str | list[int]) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4}).encode()


def assert_refused(reply: tuple[int, dict, float], status: int, says: str) -> None:
    code, body, _ = reply
    assert code == status and body["error"]["code"] == status and says in body["error"]["message"], body


def small_request(server: Server) -> float:
    """Seconds a 4-token completion takes."""
    start = time.monotonic()
    out = server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="The sea was", max_tokens=4,
                                             temperature=0)
    assert out.usage.completion_tokens == 4
    return time.monotonic() - start


def test_bodies_over_the_limit_get_413_announced_or_chunked(server):
    too_big = (LIMIT_MB + 6) * 1_000_000
    assert_refused(server.post("/v1/completions", b" " * too_big), 413, f"limit of {LIMIT_MB} MB")
    assert_refused(server.post("/v1/completions", (b" " * 1_000_000 for _ in range(too_big // 1_000_000))), 413,
                   "--max-request-mb")
    assert_refused(server.post("/v1/completions", b" " * too_big, key=None), 413, "limit")  # before the key is read
    assert server.healthy()


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(server):
    assert_refused(server.post("/v1/completions", completion("x" * HUGE_CHARS)), 400, CANNOT_FIT)
    assert_refused(server.post("/v1/completions", completion(["fits", "y" * HUGE_CHARS])), 400, CANNOT_FIT)
    assert_refused(server.post("/v1/completions", completion([7] * 1_000_000)), 400, "1000000 tokens")
    chat = {"messages": [{"role": "user", "content": "z" * HUGE_CHARS}], "max_tokens": 4}
    assert_refused(server.post("/v1/chat/completions", json.dumps(chat).encode()), 400, CANNOT_FIT)
    assert_refused(server.post("/tokenize", json.dumps({"prompt": "x" * HUGE_CHARS}).encode()), 400, CANNOT_FIT)
    # a prompt at the bound is tokenized and answered as before: 82,944 characters of 81 are 1024 tokens
    at_bound = {"prompt": ("\n" + " " * 80) * MAX_LEN, "add_special_tokens": False}
    status, body, _ = server.post("/tokenize", json.dumps(at_bound).encode())
    assert status == 200 and body["count"] == MAX_LEN


def test_too_many_stop_strings_are_refused(server):
    body = {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(500_000)]}
    assert_refused(server.post("/v1/completions", json.dumps(body).encode()), 400, "at most 256 stop strings")


def test_a_small_request_is_served_while_huge_ones_are_refused(server):
    small_request(server)  # warm
    huge = completion("x" * HUGE_CHARS)
    with ThreadPoolExecutor(3) as pool:
        refusals = [pool.submit(server.post, "/v1/completions", huge) for _ in range(3)]
        time.sleep(0.2)  # the uploads are under way
        latency = small_request(server)
        replies = [r.result(timeout=120) for r in refusals]
    for reply in replies:
        assert_refused(reply, 400, CANNOT_FIT)
        assert reply[2] < QUICK_S
    assert latency < QUICK_S


def test_refused_uploads_leave_resident_memory_where_it_was(server):
    small_request(server)  # whatever serving first takes (KV pages, arenas) is taken before measuring
    before = server.rss_mb()
    uploads = [completion("x" * HUGE_CHARS), completion([7] * 1_000_000), b" " * (LIMIT_MB + 6) * 1_000_000]
    with ThreadPoolExecutor(3) as pool:
        for _ in range(2):  # memory a refusal took is reused by the next
            for reply in pool.map(lambda body: server.post("/v1/completions", body), uploads * 2):
                assert reply[0] in (400, 413)
    small_request(server)
    assert server.rss_mb() - before < RSS_SLACK_MB



# --- a client that writes its whole body before reading -------------------------------------------------------
@pytest.fixture(scope="module")
def small_limit(tmp_path_factory):
    """A server with a 1 MB body limit and no API key."""
    with serve(tmp_path_factory.mktemp("serve-1mb") / "server.log", "--max-running", "1", "--max-model-len", "256",
               "--draft", "none", "--max-request-mb", "1") as srv:
        yield srv


@pytest.mark.parametrize("chunked", [False, True], ids=["announced", "chunked"])
def test_urllib_reads_the_413_of_a_body_over_the_limit(small_limit, chunked):
    """urllib writes the whole body, then reads the answer, and asks to close the connection: where the server
    answered and closed without reading the body, urllib saw the connection reset; now the rest is read first."""
    url = f"{small_limit.base}/v1/completions"
    for mb in (2, 30, 2):
        body = (b" " * 1_000_000 for _ in range(mb)) if chunked else b" " * (mb * 1_000_000)
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=60)
        assert e.value.code == 413 and time.monotonic() - start < QUICK_S
        assert_envelope(json.loads(e.value.read()), 413)
    status, body = http_json(url, {"prompt": "The sea was", "max_tokens": 2}, key=None)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def first_line(port: int, headers: str) -> str:
    """The status line the server answers a POST of these headers with, its body never sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=QUICK_S) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        return s.makefile("rb").readline().decode().strip()


def test_no_wait_for_a_body_never_to_be_read(small_limit):
    """A client waiting for `100 Continue` is refused at once (curl then sends nothing), and so is a body announced
    longer than the server would read and throw away."""
    waiting = first_line(small_limit.port, "Content-Length: 5000000\r\nExpect: 100-continue\r\n")
    assert waiting.startswith("HTTP/1.1 413 ")
    huge = 2_000_000 + DRAIN_BYTES
    assert first_line(small_limit.port, f"Content-Length: {huge}\r\n").startswith("HTTP/1.1 413")
