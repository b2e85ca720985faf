"""A live `specdec serve` on loopback for the serving tests: started as a subprocess on a free port,
ready once /health answers, stopped with SIGTERM.

    server = ServerProcess("--method", "plain", "--max-batch-size", "1")
    client = server.client()                      # openai.OpenAI on its /v1
    server.metrics()["specdec_cache_rows_in_use"] # summed over labels
    assert server.stop() == 0                     # SIGTERM, then the exit code
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import specdec
import specdec_kernels

INSTALL = "pip install '.[serve,test]'"
DEPENDENCIES = ("starlette", "uvicorn", "openai", "httpx")
START_TIMEOUT_S = 900  # model load + the adaptive cost model on a loaded 2-core machine
MODEL_NAME = "smollm2-test"  # --served-model-name of the test servers


def sample(name: str, **labels) -> str:
    """A labelled sample's key in ServerProcess.metrics(): name{model="...",k="v",...}."""
    inner = ",".join(f'{k}="{v}"' for k, v in {"model": MODEL_NAME, **labels}.items())
    return f"{name}{{{inner}}}"


def skip_without_dependencies():
    """Module level: the serving tests need the serve extra and the openai client."""
    for module in DEPENDENCIES:
        pytest.importorskip(module, reason=f"{module} is not installed: {INSTALL}")


class ServerProcess:
    def __init__(self, *flags: str):
        roots = {
            os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
            for m in (specdec, specdec_kernels)
        }
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]),
            PYTHONUNBUFFERED="1",
        )
        self.flags = flags
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specdec-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec", "serve", "--port", "0", *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tempfile.gettempdir(),  # `-m` puts the cwd first: not the checkout's sources
        )
        self.url = self._wait_ready()
        self.base_url = self.url + "/v1"

    def _wait_ready(self) -> str:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specdec serve exited {self.proc.returncode}:\n{self.output()}")
            if url is None:
                m = re.search(r"on (http://\S+:\d+)", self.output())
                url = m and m[1]
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"specdec serve did not start in {START_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=300, **kwargs)

    def metrics(self) -> dict:
        """{metric name: value summed over its label sets} of the samples of GET /metrics,
        and {name{labels}: value} for each labelled sample."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0]
            out[sample] = float(value)
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Polls /metrics until no request holds a cache row or waits -> the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["specdec_cache_rows_in_use"] == 0 and m["specdec_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self, sig=signal.SIGTERM, timeout: float = 120.0) -> int:
        """Sends sig -> the exit code (killed after timeout seconds: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
