"""The server's parts without a server: request parsing, streamed text, metrics, flags."""

import argparse

import pytest
from live_server import skip_without_dependencies

skip_without_dependencies()

from specdec.serve import protocol  # noqa: E402
from specdec.serve.errors import APIError  # noqa: E402
from specdec.serve.metrics import Metrics  # noqa: E402
from specdec.serve.text_stream import TextStream  # noqa: E402

CONTEXT = 64
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir, load_tokenizer

    tokenizer = load_tokenizer(gguf_checkpoint_dir(default_model_path()))
    return protocol.ServedModel("m", tokenizer, CONTEXT, 49152)


def refused(parse, body, served) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, served)
    return e.value


def test_chat_defaults_follow_openai(served):
    g = protocol.parse_chat({"messages": HI}, served)
    p = g.params
    assert g.prompt_ids == served.tokenizer.apply_chat_template(HI)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        1.0, 1.0, 0, None, (), False,
    )  # fmt: skip
    assert p.max_new_tokens == CONTEXT - len(g.prompt_ids)  # the rest of the context
    assert not g.stream and not g.include_usage and g.endpoint == "chat"
    c = protocol.parse_completion({"prompt": "hi"}, served)
    assert c.params.max_new_tokens == 16 and c.endpoint == "completion"
    assert c.prompt_ids == served.tokenizer.encode("hi", add_special_tokens=True)


def test_fields_reach_the_sampling_params(served):
    g = protocol.parse_chat(
        {
            "model": "m",
            "messages": HI,
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "seed": -5,
            "stop": "x",
            "ignore_eos": True,
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
        },
        served,
    )
    p = g.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 0, -5)
    assert p.stop == ("x",) and p.ignore_eos and g.stream and g.include_usage
    ids = protocol.parse_completion({"prompt": [[1, 2, 3]], "max_tokens": 3}, served).prompt_ids
    assert ids == [1, 2, 3]
    assert protocol.parse_completion({"prompt": ["hi"]}, served).prompt_ids == (
        served.tokenizer.encode("hi", add_special_tokens=True)
    )


def test_neutral_values_of_unimplemented_fields_are_accepted(served):
    neutral = {
        "logprobs": False,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "store": False,
        "parallel_tool_calls": True,
        "messages": [
            {"role": "user", "content": "hi", "name": None},
            {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("and", "you?")]},
        ],
    }  # fmt: skip
    g = protocol.parse_chat(neutral, served)
    text = served.tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
    assert "hello" in text and "and\nyou?" in text
    # ... and anything else is refused, naming the field
    for name, value in (("logprobs", True), ("frequency_penalty", 0.1), ("logit_bias", {"1": 1})):
        e = refused(protocol.parse_chat, {**neutral, name: value}, served)
        assert e.status == 400 and e.param == name and name in e.message


def test_developer_is_the_system_role(served):
    as_developer = [{"role": "developer", "content": "Be brief."}, *HI]
    as_system = [{"role": "system", "content": "Be brief."}, *HI]
    a = protocol.parse_chat({"messages": as_developer}, served).prompt_ids
    assert a == protocol.parse_chat({"messages": as_system}, served).prompt_ids


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": HI, "temperature": False}, 400, "temperature"),
        ({"messages": HI, "temperature": 2.5}, 400, "temperature"),
        ({"messages": HI, "top_k": 49153}, 400, "top_k"),
        ({"messages": HI, "seed": 1.0}, 400, "seed"),
        ({"messages": HI, "seed": 2**64}, 400, "seed"),
        ({"messages": HI, "stop": ["a"] * 17}, 400, "stop"),
        ({"messages": HI, "stop": [1]}, 400, "stop"),
        ({"messages": HI, "max_tokens": CONTEXT}, 400, "max_tokens"),
        ({"messages": HI, "n": True}, 400, "n"),
        ({"messages": HI, "stream": True, "stream_options": []}, 400, "stream_options"),
        (
            {"messages": HI, "stream": True, "stream_options": {"include_usage": 1}},
            400,
            "stream_options.include_usage",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages[0].content[0].text",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]},
            400,
            "messages[0].tool_call_id",
        ),  # fmt: skip
        ({"messages": [{"role": None, "content": "x"}]}, 400, "messages[0].role"),
        ({"messages": HI, "model": "other"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "word " * 80}]}, 400, "messages"),
    ],
)
def test_bad_chat_requests(served, body, status, param):
    e = refused(protocol.parse_chat, body, served)
    assert (e.status, e.param) == (status, param), e.message
    assert e.body()["error"]["param"] == param and e.body()["error"]["message"]


def test_context_leaves_room_for_the_completion(served):
    n = len(served.tokenizer.apply_chat_template(HI))
    assert protocol.parse_chat({"messages": HI, "max_tokens": CONTEXT - n}, served)
    e = refused(protocol.parse_chat, {"messages": HI, "max_tokens": CONTEXT - n + 1}, served)
    assert e.code == "context_length_exceeded" and str(CONTEXT - n) in e.message
    ids = list(range(1, CONTEXT))  # one position left: a default completions max_tokens of 1
    assert protocol.parse_completion({"prompt": ids}, served).params.max_new_tokens == 1


def test_json_bodies():
    assert protocol.parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"", b"{", b"[]", b'"x"', b'{"a": NaN}', b'{"a": Infinity}', b"[" * 50000):
        with pytest.raises(APIError) as e:
            protocol.parse_json(body)
        assert e.value.status == 400


class CharTokenizer:
    """Token id = one character, except 1000 + n: the first / second half of a 2-byte
    character (decoded as U+FFFD alone, as a byte-level tokenizer does)."""

    def decode(self, ids):
        out, i = "", 0
        while i < len(ids):
            if ids[i] == 1000 and i + 1 < len(ids) and ids[i + 1] == 1001:
                out, i = out + "é", i + 2
            elif ids[i] >= 1000:
                out, i = out + "\ufffd", i + 1
            else:
                out, i = out + chr(ids[i]), i + 1
        return out


def test_text_stream_holds_back_stop_prefixes_and_split_characters():
    tok = CharTokenizer()
    stream = TextStream(tok, stop=("END",))
    sent = [stream.add([ord(c)]) for c in "abcE"]
    assert "".join(sent) == "ab"  # "cE" may begin "END": held back
    assert stream.add([ord("N")]) == "c"  # "EN" may still become "END"
    assert stream.finish("abc") == ""  # the engine cut "END" off: "EN" is never sent
    other = TextStream(tok, stop=("END",))
    assert other.add([ord(c) for c in "xyEN"]) == "xy" and other.finish("xyENx") == "ENx"
    plain = TextStream(tok)
    assert plain.add([ord("a"), 1000]) == "a"  # half a character: not sent yet
    assert plain.add([1001]) == "é"
    assert plain.finish("aé") == ""


def test_metrics_text_format():
    m = Metrics("m")
    m.admit(1)
    m.observe_request("stop", 5, 3, 0.2, 0.5)
    m.observe_step("main", 0.01, 2)
    m.http_error(400)
    text = m.render()
    assert 'specdec_requests_finished_total{model="m",finish_reason="stop"} 1' in text
    assert 'specdec_http_errors_total{model="m",status="400"} 1' in text
    assert 'specdec_time_to_first_token_seconds_bucket{model="m",le="0.25"} 1' in text
    assert 'specdec_time_to_first_token_seconds_bucket{model="m",le="0.1"} 0' in text
    assert 'specdec_time_per_output_token_seconds_sum{model="m"} 0.15' in text
    assert 'specdec_requests_waiting{model="m"} 1' in text  # admitted, holding no row
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_serve_shares_the_generate_flags():
    """--model, the placement, drafter and tree flags mean what they mean for generate."""
    from specdec.cli import generate
    from specdec.cli import serve as command

    def actions(add):
        p = argparse.ArgumentParser()
        add(p)
        return {a.dest: a for a in p._actions}

    gen, serve = actions(generate.add_arguments), actions(command.add_arguments)
    shared = ["model", "device", "dtype", "compile", "method", "head", "tree", "max_seq_len"]
    shared += ["ngram_max", "ngram_min", "draft_model", "medusa"]
    for dest in shared:
        a, b = gen[dest], serve[dest]
        assert (a.option_strings, a.default, a.choices, a.type) == (
            b.option_strings, b.default, b.choices, b.type,
        ), dest  # fmt: skip
    for flag in ("--host", "--port", "--max-batch-size", "--max-queue", "--served-model-name",
                 "--api-key"):  # fmt: skip
        assert any(flag in a.option_strings for a in serve.values()), flag


def test_seeded_tree_fits_the_cost_model():
    from specdec import TreeSpec
    from specdec.cli.serve import seeded_tree

    class Cost:
        def verify(self, T, batch=None):  # flat up to 4 nodes, then +50% a node
            return 1.0 if T <= 4 else 1.0 + 0.5 * (T - 4)

    assert seeded_tree(Cost(), TreeSpec.parse("adaptive:6,8,32")) == TreeSpec.parse("dynamic:3,3,4")
    assert seeded_tree(Cost(), TreeSpec.parse("adaptive:2,2,3")) == TreeSpec.parse("dynamic:2,2,3")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "99999"], "--port must be in [0, 65535]"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--api-key", " "], "--api-key must not be empty"),
        (["--tree", "chain:0"], "tree depth must be >= 1"),
        (["--method", "eagle+ngram", "--tree", "chain:2"], "needs a dynamic or adaptive --tree"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(capsys, flags, message):
    from specdec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_taken_port_fails_before_the_model_loads(capsys):
    import socket

    from specdec.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", str(taken.getsockname()[1])])
    assert e.value.code == 2 and "cannot listen there" in capsys.readouterr().err
