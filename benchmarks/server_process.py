"""One OpenAI-compatible server as a subprocess of a benchmark: started, awaited until it
answers GET /v1/models, its resident memory read, stopped with SIGTERM. Used by
bench_serve.py and soak_serve.py.

    server = ServerProcess("specdec-plain", [sys.executable, "-m", "specdec", "serve", ...],
                           port, env, log_path)
    server.wait_ready(timeout=900)
    server.rss_bytes()     # the server's resident set (its process tree)
    server.stop()          # SIGTERM, then SIGKILL after a grace period -> exit code
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0, headers: dict | None = None) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError):
        return 0, ""


class ServerProcess:
    def __init__(self, name: str, argv: list, port: int, env: dict | None, log_path: str):
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        # The server starts outside the checkout (`-m` puts the cwd first on sys.path, and the
        # checkout's unbuilt specdec_kernels would shadow the installed one); a PYTHONPATH the
        # caller set, relative to here, is made absolute so that it still means the same.
        env = dict(os.environ if env is None else env)
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join(
                os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p
            )
        # its own process group: SIGTERM reaches the server, not this script
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Blocks until GET /v1/models answers 200 -> seconds since the start; RuntimeError
        (with the log's tail) when the process exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            status, body = http_get(self.url + "/v1/models", timeout=5)
            if status == 200 and json.loads(body).get("data"):
                return time.monotonic() - self.started
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of the server and its child processes (vLLM runs its engine in
        one), from /proc."""
        total = 0
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 90.0) -> int | None:
        """SIGTERM to its process group, SIGKILL after `grace` seconds -> its exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _children(pid: int) -> list:
    """Every descendant of pid (/proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out
