"""The real `openai` client against a live `specdec serve` (float32: greedy output is exact).

One server for the module: the default drafter and tree (EAGLE, adaptive), two batch rows, so
that a third concurrent request queues. Its greedy answers are checked against `specdec
generate`'s with the same flags; streamed answers against unstreamed ones."""

import concurrent.futures
import json
import threading

import pytest
from live_server import MODEL_NAME, ServerProcess, sample, skip_without_dependencies

skip_without_dependencies()

import httpx  # noqa: E402

from specdec.cli import main  # noqa: E402

# shared with `specdec generate`; on the CPU whatever the machine: the disconnect test needs
# requests that outlast the client's patience
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-seq-len", "512"]
PROMPTS = [
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about rain.",
    "Why is the sky blue?",
]
RAW_PROMPT = "The capital of France is"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*FLAGS, "--max-batch-size", "2", "--served-model-name", MODEL_NAME)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """{prompt: `specdec generate`'s output row} for PROMPTS, with the server's flags."""
    d = tmp_path_factory.mktemp("generate")
    (d / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    main(["generate", "--prompts", str(d / "in.jsonl"), *FLAGS, "--max-new-tokens",
          str(NEW_TOKENS), "--output", str(d / "out.jsonl")])  # fmt: skip
    rows = [json.loads(line) for line in (d / "out.jsonl").read_text().splitlines()]
    return {row["prompt"]: row for row in rows}


@pytest.fixture(scope="module")
def tokenizer():
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir, load_tokenizer

    return load_tokenizer(gguf_checkpoint_dir(default_model_path()))


def chat(client, prompt, **kw):
    kw.setdefault("max_tokens", NEW_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], **kw
    )


def streamed_chat(client, prompt, **kw):
    """-> (content joined, finish reasons seen, usage of the last chunk, chunks)."""
    kw.setdefault("max_tokens", NEW_TOKENS)
    kw.setdefault("temperature", 0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], stream=True, **kw
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return text, reasons, chunks[-1].usage, chunks


def finish_reason(row) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}[row["finish_reason"]]


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_greedy_chat_and_completion_equal_generate(client, generated, tokenizer):
    for prompt in PROMPTS[:2]:
        row = generated[prompt]
        r = chat(client, prompt)
        assert r.choices[0].message.content == row["text"]
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == finish_reason(row)
        assert r.usage.completion_tokens == len(row["token_ids"])
        chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        assert r.usage.prompt_tokens == len(chat_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.model == MODEL_NAME and r.object == "chat.completion"
    # the same prompt as token ids on /v1/completions: the same tokens
    row = generated[PROMPTS[0]]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=NEW_TOKENS, temperature=0
    )
    assert r.choices[0].text == row["text"] and r.choices[0].finish_reason == finish_reason(row)
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == len(row["token_ids"])
    assert r.usage.prompt_tokens == len(prompt_ids)
    # raw text is tokenized as `specdec generate --no-chat-template` does
    r = client.completions.create(model=MODEL_NAME, prompt=RAW_PROMPT, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(tokenizer.encode(RAW_PROMPT, add_special_tokens=True))
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_streamed_equals_unstreamed_with_usage(client, generated):
    prompt = PROMPTS[0]
    whole = chat(client, prompt)
    text, reasons, usage, chunks = streamed_chat(
        client, prompt, stream_options={"include_usage": True}
    )
    assert text == whole.choices[0].message.content == generated[prompt]["text"]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    _, _, no_usage, _ = streamed_chat(client, prompt)
    assert no_usage is None  # only stream_options.include_usage asks for it
    kw = dict(model=MODEL_NAME, prompt=RAW_PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    whole = client.completions.create(**kw)
    parts = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage == whole.usage
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == (
        whole.choices[0].finish_reason
    )


def test_max_tokens_ends_with_length(client):
    r = chat(client, PROMPTS[3], max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = chat(client, PROMPTS[3], max_tokens=None, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_strings_cut_the_reply(client, generated):
    full = generated[PROMPTS[3]]["text"]
    stop = full.split()[3]  # a word in the middle of the greedy reply
    expected = full[: full.index(stop)]
    r = chat(client, PROMPTS[3], stop=[stop, "never appears"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    text, reasons, _, _ = streamed_chat(client, PROMPTS[3], stop=stop)
    assert text == expected and reasons == ["stop"]


def test_seed_reproducible(client):
    def story(seed, **kw):
        return chat(client, "Tell me a story.", temperature=0.9, seed=seed, **kw)

    first = story(7)
    chat(client, "Name a fruit.", temperature=1.0)  # unseeded traffic in between
    assert story(7).choices[0].message.content == first.choices[0].message.content
    text, _, _, _ = streamed_chat(client, "Tell me a story.", temperature=0.9, seed=7)
    assert text == first.choices[0].message.content
    others = {story(s).choices[0].message.content for s in (8, 9)}
    assert others != {first.choices[0].message.content}  # the seed does steer the sampling
    top = chat(
        client, "Tell me a story.", temperature=0.9, seed=3, top_p=0.9, extra_body={"top_k": 20}
    )
    again = chat(
        client, "Tell me a story.", temperature=0.9, seed=3, top_p=0.9, extra_body={"top_k": 20}
    )
    assert top.choices[0].message.content == again.choices[0].message.content


def test_concurrent_clients(client, generated):
    """Four clients on two rows: each gets its own greedy answer."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: chat(client, p).choices[0].message.content, PROMPTS))
    assert answers == [generated[p]["text"] for p in PROMPTS]


def test_disconnect_cancels_and_frees_rows(server, client):
    before = server.metrics()
    cancelled = sample("specdec_requests_finished_total", finish_reason="cancelled")
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count to one thousand."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert server.metrics()["specdec_cache_rows_in_use"] >= 1
    stream.close()  # the client goes away mid-stream
    # a non-streamed request whose client gives up: its connection closes while it decodes
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Count to one thousand."}],
                "max_tokens": 400,
                "ignore_eos": True,
            },
            timeout=httpx.Timeout(60, read=0.5),
        )
    after = server.wait_idle()
    assert after["specdec_cache_rows_in_use"] == 0 and after["specdec_requests_waiting"] == 0
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 2
    assert chat(client, PROMPTS[0], max_tokens=4).usage.completion_tokens == 4  # still serving


BAD_CHAT = [  # (body, expected status, the field the error names)
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": 3}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"top_k": 1.5}, 400, "top_k"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": "10"}, 400, "max_tokens"),
    ({"max_tokens": 100000}, 400, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 4}, 400, "max_tokens"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({"n": 2}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"extra": 1}}, 400, "stream_options.extra"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": [""]}, 400, "stop"),
    ({"seed": "x"}, 400, "seed"),
    ({"seed": 2**70}, 400, "seed"),
    ({"ignore_eos": "no"}, 400, "ignore_eos"),
    ({"user": 5}, 400, "user"),
    ({"foo": 1}, 400, "foo"),
    ({"model": 5}, 400, "model"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
]
BAD_COMPLETIONS = [
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 99999999]}, 400, "prompt"),
    ({"prompt": 3.5}, 400, "prompt"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ({"prompt": "hi", "logprobs": 1}, 400, "logprobs"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
]


def test_bad_requests_get_4xx_while_a_good_one_completes(server, client, generated):
    good = {}
    thread = threading.Thread(
        target=lambda: good.update(
            zip(("text", "reasons", "usage", "chunks"), streamed_chat(client, PROMPTS[3]))
        )
    )
    thread.start()
    ok_message = [{"role": "user", "content": "hi"}]
    checked = 0
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for body, status, param in BAD_CHAT:
            body = {"messages": ok_message, **body} if "messages" not in body and body else body
            r = http.post("/chat/completions", json=body)
            checked += _check_error(r, status, param, body)
        for body, status, param in BAD_COMPLETIONS:
            checked += _check_error(http.post("/completions", json=body), status, param, body)
        raw = [
            (http.post("/chat/completions", content=b"not json"), 400),
            (http.post("/chat/completions", content=b"[1, 2]"), 400),
            (http.post("/chat/completions", content=b'{"messages": [], "temperature": NaN}'), 400),
            (http.post("/chat/completions", content=b"[" * 100000), 400),
            (http.post("/chat/completions", content=b"\xff\xfe\x00"), 400),
            (http.post("/chat/completions", content=b"{" + b" " * (5 * 2**20) + b"}"), 413),
            (http.get("/chat/completions"), 405),
            (http.post("/nothing", json={}), 404),
            (http.get("/models/other"), 404),
        ]
        for r, status in raw:
            checked += _check_error(r, status, None, r.request.url)
    thread.join()
    assert checked >= 30
    assert good["text"] == generated[PROMPTS[3]]["text"]
    assert good["reasons"] == [finish_reason(generated[PROMPTS[3]])]
    m = server.wait_idle()
    assert m["specdec_cache_rows_in_use"] == 0


def _check_error(r, status, param, what) -> int:
    assert r.status_code == status, (what, r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error", (what, error)
    if param is not None:
        assert error["param"] == param, (what, error)
        assert param.split(".")[-1].split("[")[0] in error["message"], (what, error)
    return 1


def test_metrics_after_traffic(server):
    m = server.metrics()
    assert m["specdec_time_to_first_token_seconds_count"] > 0
    assert m["specdec_time_per_output_token_seconds_count"] > 0
    assert m["specdec_e2e_request_latency_seconds_count"] > 0
    assert m["specdec_generation_tokens_total"] > 0 and m["specdec_prompt_tokens_total"] > 0
    assert m["specdec_mean_acceptance_length"] >= 1.0
    assert m[sample("specdec_cache_rows", lane="main")] == 2
    assert m["specdec_engine_steps_total"] > 0 and m["specdec_engine_step_rows_count"] > 0
    assert sample("specdec_acceptance_rate", depth=1) in m
    assert sample("specdec_adaptive_tree_nodes", lane="main") in m
    assert m["specdec_http_errors_total"] >= 30
    assert m["specdec_requests_running"] == 0
