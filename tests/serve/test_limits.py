"""A live `specdec serve` at its limits: the API key, a full queue, SIGTERM.

Plain decoding, two batch rows and no queue (--max-queue 0), so two streams fill it."""

import signal
import threading

import pytest
from live_server import MODEL_NAME, ServerProcess, skip_without_dependencies

skip_without_dependencies()

import httpx  # noqa: E402
import openai  # noqa: E402

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = [
    "--method", "plain", "--device", "cpu", "--dtype", "float32", "--max-batch-size", "2",
    "--max-queue", "0",
    "--api-key", KEY, "--shutdown-timeout", "10", "--served-model-name", MODEL_NAME,
]  # fmt: skip


def long_request(tokens=2000):
    """A request that decodes for far longer than the tests wait (EOS ignored)."""
    return {
        "messages": [{"role": "user", "content": "Count to ten thousand."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*FLAGS)
    yield s
    s.stop()


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError) as no_key:
        server.client().models.list()
    assert no_key.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    r = server.client(api_key=KEY).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.usage.completion_tokens >= 1
    raw = httpx.post(server.base_url + "/completions", json={"prompt": "hi"})
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "invalid_api_key"
    assert raw.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_full_queue_gets_503_with_retry_after(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        with (
            http.stream("POST", "/chat/completions", json=long_request()) as a,
            http.stream("POST", "/chat/completions", json=long_request()) as b,
        ):
            assert a.status_code == b.status_code == 200
            r = http.post("/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
        # both clients went away: their rows are free again
        m = server.wait_idle()
        assert m["specdec_cache_rows_in_use"] == 0
        assert http.post("/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_sigterm_finishes_in_flight_requests_and_exits_zero(server):
    """In flight at SIGTERM: a short request completes; one longer than --shutdown-timeout is
    cut off; nothing new is admitted; the exit code is 0."""
    results = {}

    def short():
        results["short"] = httpx.post(
            server.base_url + "/chat/completions",
            headers=AUTH,
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
            },  # fmt: skip
            timeout=120,
        )

    def long():
        body = b""
        try:
            with httpx.stream(
                "POST",
                server.base_url + "/chat/completions",
                headers=AUTH,
                json=long_request(),
                timeout=120,
            ) as r:
                for chunk in r.iter_bytes():
                    body += chunk
        except httpx.HTTPError as e:
            results["long_error"] = e
        results["long"] = body

    threads = [threading.Thread(target=long), threading.Thread(target=short)]
    threads[0].start()
    _wait_for(lambda: server.metrics()["specdec_requests_running"] == 1)
    threads[1].start()
    _wait_for(lambda: server.metrics()["specdec_requests_running"] == 2)
    server.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _health(server) != 200)
    with pytest.raises(httpx.TransportError):  # the listening socket is closed
        httpx.post(server.base_url + "/completions", headers=AUTH, json={"prompt": "hi"})
    for t in threads:
        t.join(timeout=180)
    assert server.proc.wait(timeout=120) == 0, server.output()
    short_reply = results["short"]
    assert short_reply.status_code == 200, short_reply.text
    assert short_reply.json()["usage"]["completion_tokens"] == 8
    assert b"data: [DONE]" not in results["long"]  # cancelled at the timeout, never completed
    assert b'"finish_reason":"length"' not in results["long"]


def _health(server) -> int:
    try:
        return httpx.get(server.url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


def _wait_for(condition, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
