"""Log-probabilities through `magicdec serve`: completions (OpenAI's legacy format, echo, vLLM's prompt_logprobs), chat
(`logprobs` + `top_logprobs`), streamed and not, and lm-evaluation-harness's scoring request, on a small server of
this module's own (2 slots, fp32, drafting with `--draft self-quant`: test_server.py's server drafts sparsely). Values are checked against offline plain decoding of each prompt
alone; the server drafts, and in fp32 on torch's operators a verification forward may round the last bits of a
logit differently from a one-token step, so they agree within 1e-4 (bit for bit where the native kernels run:
tests/test_logprobs.py)."""

from __future__ import annotations

import pytest

from test_server import KEY, PROMPT, http_json, metric, serve
from magicdec.logprobs import MAX_LOGPROBS
from magicdec.sampling import SamplingParams

openai = pytest.importorskip("openai")

TOL = 1e-4


@pytest.fixture(scope="module")
def lp_server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve-logprobs") / "server.log", "--max-running", "2", "--max-model-len",
               "512", "--draft", "self-quant", "--gamma", "3", "--api-key", KEY,
               "--dtype", "fp32") as srv:
        yield srv


@pytest.fixture(scope="module")
def model_name(lp_server) -> str:
    return lp_server.client().models.list().data[0].id


def offline(llm, prompt: str | list[int], max_tokens: int, **params):
    kw = {"prompt_token_ids": [prompt]} if isinstance(prompt, list) else {"prompts": [prompt]}
    return llm.generate(params=SamplingParams(max_tokens=max_tokens, **params), **kw)[0]


def test_completion_logprobs_are_plain_decodings(lp_server, model_name, llm):
    out = lp_server.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                logprobs=5)
    want = offline(llm, PROMPT, 8, logprobs=5)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == want.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=TOL)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top, entry in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert 5 <= len(top) <= 6 and top[token] == value  # the five most probable, and the chosen token
        assert max(top.values()) == pytest.approx(entry.top[0][1], abs=TOL)  # greedy: the chosen is the top


def test_greedy_completion_is_plain_decodings_and_drafted(lp_server, model_name, llm):
    """The server's 4-bit draft changed nothing of the text, and it did draft: /metrics counts its rounds and the
    tokens the target accepted of them."""
    drafts = metric(lp_server.base, "magicdec:spec_decode_num_drafts_total")
    out = lp_server.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline(llm, PROMPT, 24).text
    assert metric(lp_server.base, "magicdec:spec_decode_num_drafts_total") > drafts
    assert metric(lp_server.base, "magicdec:spec_decode_num_accepted_tokens_total") > 0


def test_streamed_completion_logprobs_add_up_to_the_whole(lp_server, model_name):
    client = lp_server.client()
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((lp.tokens for lp in streamed), []) == whole.logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == whole.logprobs.text_offset
    assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(whole.logprobs.token_logprobs, abs=TOL)


def test_streamed_echo_sends_the_prompt_first(lp_server, model_name, llm):
    client = lp_server.client()
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    prompt_text = llm.tokenizer.decode(llm.tokenizer.encode(PROMPT))
    assert chunks[0].text.startswith(prompt_text) and whole.text.startswith(prompt_text)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = sum((c.logprobs.token_logprobs for c in chunks if c.logprobs is not None), [])
    assert streamed[0] is None is whole.logprobs.token_logprobs[0]
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOL)
    assert len(streamed) == len(llm.tokenizer.encode(PROMPT)) + 4


def test_chat_logprobs_and_top_logprobs_streamed_or_not(lp_server, model_name):
    client = lp_server.client()
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=TOL)
        assert bytes(c.bytes).decode() == c.token
    streamed = [item for chunk in client.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(lp_server, model_name, llm, max_tokens):
    """lm-evaluation-harness's local-completions scores a context + continuation with `echo`, `logprobs: 1` and
    token-id prompts in a batch (it sends max_tokens 1 and drops the last position; vLLM's max_tokens 0 gives the
    prompt alone): every prompt token's log-probability, the first None, as the model's log_softmax gives them."""
    prompts = [llm.tokenizer.encode(PROMPT), llm.tokenizer.encode("Once upon a time, in a land far away")]
    status, body = http_json(f"{lp_server.base}/v1/completions",
                             {"model": model_name, "prompt": prompts, "echo": True, "max_tokens": max_tokens,
                              "logprobs": 1, "temperature": 0, "seed": 1234})
    assert status == 200, body
    for choice, prompt in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        want = offline(llm, prompt, 1, logprobs=1, prompt_logprobs=1)
        assert len(lp["token_logprobs"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs[1:]], abs=TOL)
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):  # lm-eval's is_greedy reads these
            assert value in top.values() and max(top.values()) >= value
        prompt_text = llm.tokenizer.decode(prompt)
        assert choice["text"] == prompt_text + (want.text if max_tokens else "")
    completion_tokens = body["usage"]["completion_tokens"]
    assert completion_tokens == 2 * max_tokens


def test_prompt_logprobs_extension(lp_server, model_name, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    status, body = http_json(f"{lp_server.base}/v1/completions",
                             {"model": model_name, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    want = offline(llm, prompt, 1, prompt_logprobs=2).prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None and body["choices"][0]["logprobs"] is None
    for position, token, entry in zip(got[1:], prompt[1:], want[1:]):
        assert position[str(token)]["logprob"] == pytest.approx(entry.logprob, abs=TOL)
        assert sorted(v["rank"] for v in position.values() if v["rank"] is not None) == [1, 2]


def test_bad_logprob_values_are_refused(lp_server, model_name):
    url = f"{lp_server.base}/v1/completions"
    for bad in ({"logprobs": MAX_LOGPROBS + 1}, {"logprobs": -1}, {"prompt_logprobs": 99}, {"max_tokens": 0}):
        status, body = http_json(url, {"model": model_name, "prompt": PROMPT, "max_tokens": 2, **bad})
        assert status == 400, (bad, body)
    chat = f"{lp_server.base}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}]
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
                {"logprobs": True, "prompt_logprobs": 1}):
        status, body = http_json(chat, {"model": model_name, "messages": messages, "max_tokens": 2, **bad})
        assert status == 400, (bad, body)
