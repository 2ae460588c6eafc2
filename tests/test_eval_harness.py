"""lm-evaluation-harness against a live `magicdec serve`, with no tokenizer of its own: its `local-completions` model
finds the server's /tokenizer_info and tokenizes through /tokenize (its remote tokenizer), then scores and generates
through /v1/completions; `local-chat-completions` sends chat messages. lm-eval's own client code runs here, on this
module's server (2 slots, fp32, sparse self-speculation, an API key), and what it computes is checked against offline
plain decoding of each prompt alone: log-likelihoods within test_server_logprobs's tolerance, greedy texts equal.
Skipped where lm-eval is not installed (`pip install -e .[eval]`)."""

from __future__ import annotations

import json

import pytest

from test_server import KEY, http_json, serve
from test_server_logprobs import TOL, offline

lm_eval_models = pytest.importorskip("lm_eval.models.openai_completions")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.api_models import JsonChatStr  # noqa: E402
from lm_eval.utils import RemoteTokenizer  # noqa: E402

MAX_LEN = 1024
REQUEST_S = 120  # lm-eval's timeout of one request, on a busy 2-core machine
PAIRS = [("The capital of France is", " Paris"), ("The old lighthouse keeper climbed the stairs ", "and lit the lamp"),
         ("", "Once upon a time")]  # a trailing space moves to the continuation; an empty context scores after BOS
UNTIL = {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}


@pytest.fixture(scope="module")
def eval_server(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("OPENAI_API_KEY", KEY)  # lm-eval's local models send it as the bearer token
    with serve(tmp_path_factory.mktemp("serve-eval") / "server.log", "--max-running", "2", "--max-model-len",
               str(MAX_LEN), "--draft", "self-streaming", "--budget", "64", "--gamma", "3", "--api-key", KEY,
               "--dtype", "fp32") as srv:
        yield srv


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def completions_lm(eval_server):
    """lm-eval's local-completions model as `--model_args base_url=...,tokenized_requests=True` makes it."""
    return lm_eval_models.LocalCompletionsAPI(base_url=f"{eval_server.base}/v1/completions", tokenized_requests=True,
                                              max_length=MAX_LEN, max_retries=1, timeout=REQUEST_S)


def test_tokenizer_info_is_the_tokenizers_config(eval_server, hf_tokenizer):
    status, info = http_json(f"{eval_server.base}/tokenizer_info", key=None)  # open, as /tokenize is
    assert status == 200
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == \
           (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token) == \
           ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert info["chat_template"] == hf_tokenizer.chat_template and info["model_max_length"] == MAX_LEN
    assert info["add_bos_token"] is False


def test_lm_eval_takes_the_servers_tokenizer(completions_lm, llm):
    assert completions_lm.tokenizer_backend == "remote" and isinstance(completions_lm.tokenizer, RemoteTokenizer)
    assert completions_lm.eot_token_id == llm.tokenizer.eos_ids[0] and completions_lm.eos_string == "<|im_end|>"
    assert completions_lm.prefix_token_id == llm.tokenizer.bos_id
    text = "Mr. Knightley's 日本語 🙂\n\n<|im_end|>"
    assert completions_lm.tok_encode(text) == llm.tokenizer.encode(text, add_bos=False)
    ids = [llm.tokenizer.bos_id, *llm.tokenizer.encode(text, add_bos=False)]
    assert completions_lm.tokenizer.decode(ids) == "<|im_start|>" + text  # special tokens kept, as vLLM's


def reference_loglikelihood(llm, context: str, continuation: str) -> tuple[float, bool]:
    """The log-likelihood of `continuation` after `context` and whether greedy decoding gives it, from offline plain
    decoding of the ids lm-eval sends (the context's trailing spaces move to the continuation; an empty context is
    BOS)."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    if context:
        prefix = llm.tokenizer.encode(context, add_bos=False)
        whole = llm.tokenizer.encode(context + continuation, add_bos=False)
    else:
        prefix = [llm.tokenizer.bos_id]
        whole = prefix + llm.tokenizer.encode(continuation, add_bos=False)
    scored = offline(llm, whole, 1, logprobs=1, prompt_logprobs=1).prompt_logprobs[len(prefix):]
    return sum(e.logprob for e in scored), all(e.top[0][0] == e.token for e in scored)


def test_loglikelihoods_are_the_models(completions_lm, llm):
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got = completions_lm.loglikelihood(requests, disable_tqdm=True)
    for pair, (value, greedy) in zip(PAIRS, got):
        want, want_greedy = reference_loglikelihood(llm, *pair)
        assert value == pytest.approx(want, abs=TOL * 10), pair  # a sum of a few tokens' values, each within TOL
        assert greedy == want_greedy, pair
    assert got[0][1]  # " Paris" is the greedy continuation


def test_rolling_loglikelihood_is_the_whole_texts(completions_lm, llm):
    """A perplexity task's request: the text after BOS, in windows of the context (one here)."""
    text = "It was the best of times, it was the worst of times, it was the age of wisdom."
    [got] = completions_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)],
                                                 disable_tqdm=True)
    assert got == pytest.approx(reference_loglikelihood(llm, "", text)[0], abs=TOL * 30)


def test_greedy_generation_is_the_servers_and_plain_decodings(completions_lm, eval_server, llm):
    contexts = ["The old lighthouse keeper climbed the stairs and", "It was a dark and stormy night; the rain"]
    requests = [Instance("generate_until", {}, (context, dict(UNTIL)), i) for i, context in enumerate(contexts)]
    got = completions_lm.generate_until(requests, disable_tqdm=True)
    stop = ["\n\n", "<|im_end|>"]  # lm-eval adds the EOS text it read from /tokenizer_info
    client = eval_server.client()
    model = client.models.list().data[0].id
    for context, text in zip(contexts, got):
        ids = llm.tokenizer.encode(context, add_bos=False)
        served = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                           stop=stop).choices[0].text
        assert text == served == offline(llm, ids, 16, temperature=0, stop=tuple(stop)).text
        assert text


def test_chat_generation_needs_no_tokenizer(eval_server, llm):
    chat_lm = lm_eval_models.LocalChatCompletion(base_url=f"{eval_server.base}/v1/chat/completions", max_retries=1,
                                                 timeout=REQUEST_S)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [text] = chat_lm.generate_until([Instance("generate_until", {}, (JsonChatStr(json.dumps(messages)),
                                                                     dict(UNTIL)), 0)], disable_tqdm=True)
    status, prompt = http_json(f"{eval_server.base}/tokenize", {"messages": messages})
    assert status == 200
    assert text == offline(llm, prompt["tokens"], 16, temperature=0, stop=("\n\n",)).text
    assert "Paris" in text
