"""`specdec serve`: an OpenAI-compatible HTTP server on the online engine.

    specdec serve                                   # default model + its EAGLE head, adaptive
    specdec serve --method eagle+ngram --max-batch-size 16 --port 8080 --api-key KEY
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

The model, drafter, tree and dtype flags are `specdec generate`'s, with the same meaning and
defaults, so a greedy request gets the tokens `specdec generate` prints for the same prompt.
Everything checkable without the model (flags, the port) is checked before it loads. The
listening socket opens once the engines are built and warmed up: a client that can connect is
served at once. The engines step in the main thread, the HTTP server runs in a second one
(docs/serving.md, "Threads"). SIGTERM (or Ctrl-C) stops admitting, lets the requests in flight
finish for up to --shutdown-timeout seconds, cancels the rest and exits 0 (130 after Ctrl-C).
docs/serving.md describes the endpoints, fields, errors and metrics.
"""

import os
import signal
import socket
import sys
import threading

from specdec import envs
from specdec.bench.common import warm_up
from specdec.cli.common import (
    add_drafter_arguments,
    add_model_placement_arguments,
    add_tree_argument,
    load_model_from_args,
)
from specdec.drafters.choice import DrafterChoice
from specdec.errors import InvalidRequestError, SpecdecError

INSTALL_HINT = "pip install 'specdec[serve]' (starlette, uvicorn)"
SEEDED_LANE_ROWS = 4  # batch rows of the seeded-sampling engine (docs/serving.md, "Seeds")
# its fixed tree: the largest whose verify costs at most this many plain steps (cost model)
SEEDED_TREE_COST = 1.25
WARM_UP_PROMPT = "Hello"


def add_arguments(p):
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a .gguf file or HF checkpoint dir (default: SmolLM2-135M-Instruct)",
    )
    add_model_placement_arguments(p)
    add_drafter_arguments(p)
    add_tree_argument(p)
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="cache positions per request: a request's prompt + completion tokens (default "
        "%(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=8000, help="port (default %(default)s; 0: any free port)"
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        metavar="N",
        help="requests decoded together, each holding a KV-cache row (default %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests waiting for a row beyond those decoding; past it a request gets 503 "
        "with Retry-After (default %(default)s)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name requests give and /v1/models lists (default: the model file's name)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/* (default: SPECDEC_API_KEY if set, "
        "else no key)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish before they are "
        "cancelled (default %(default)s)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request on stderr")


def run(args) -> int:
    _check_installed()
    from specdec import TreeSpec

    # everything checkable without the model first: bad flags fail fast
    choice = DrafterChoice.from_args(args)
    tree = TreeSpec.parse(args.tree)
    choice.check_tree(tree)
    for flag in ("max_batch_size", "max_seq_len"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(
                f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
            )
    if args.max_queue < 0:
        raise InvalidRequestError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError(f"--port must be in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise InvalidRequestError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    api_key = args.api_key if args.api_key is not None else envs.SPECDEC_API_KEY
    if api_key is not None and not api_key.strip():
        raise InvalidRequestError("--api-key must not be empty")
    # a long-running process meets many prompt lengths: keep oneDNN's kernel cache small
    envs.bound_onednn_primitive_cache()
    sock = _listening_socket(args.host, args.port)
    # SIGTERM before the server runs (the model loading): nothing is in flight, stop at once
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _serve(args, choice, tree, sock, api_key)
    except _Terminated:
        print("specdec serve: stopped before serving (SIGTERM)", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


class _Terminated(Exception):
    """SIGTERM while the engines were being built."""


def _terminate(signum, frame):
    raise _Terminated()


def _serve(args, choice, tree, sock, api_key) -> int:
    import uvicorn

    from specdec import Engine
    from specdec.serve.app import Server, ServerConfig, build_app
    from specdec.serve.metrics import Metrics
    from specdec.serve.protocol import ServedModel
    from specdec.serve.worker import EngineWorker

    model, tokenizer = load_model_from_args(args)
    drafter = choice.build(model, args.model)
    engines = {
        "main": Engine(
            model,
            tokenizer,
            drafter=drafter,
            tree=tree,
            batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
        )
    }
    if engines["main"].policy is not None:
        # adaptive trees follow the load, and a sampled request's tokens follow its trees:
        # seeded sampling runs on a fixed tree (seeded_tree; docs/serving.md, "Seeds")
        engines["seeded"] = Engine(
            model,
            tokenizer,
            drafter=choice.build(model, args.model),
            tree=seeded_tree(engines["main"].policy.cost, tree),
            batch_size=min(SEEDED_LANE_ROWS, args.max_batch_size),
            max_seq_len=args.max_seq_len,
        )
    warm_ids = tokenizer.apply_chat_template([{"role": "user", "content": WARM_UP_PROMPT}])
    for engine in engines.values():
        warm_up(engine, [warm_ids])
    name = args.served_model_name or _default_name(args.model)
    served = ServedModel(
        name, tokenizer, min(e.capacity for e in engines.values()), model.args.vocab_size
    )
    metrics = Metrics(name)
    worker = EngineWorker(engines, metrics)
    server = Server(
        ServerConfig(
            served,
            max_in_flight=args.max_batch_size + args.max_queue,
            api_key=api_key,
            seeded_lane="seeded" in engines,
        ),
        worker,
        metrics,
    )
    config = uvicorn.Config(
        build_app(server),
        log_level="info",
        access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="off",
    )
    uv = _draining_uvicorn(config, server)
    host, port = sock.getsockname()[:2]
    label = f"{choice.label(drafter)} {tree}" if choice.method != "plain" else "plain"
    if "seeded" in engines:
        label += f"; seeded sampling on {engines['seeded'].tree}"
    print(
        f"specdec serve: {name} ({label}, batch {args.max_batch_size}, context "
        f"{served.context}) on http://{_url_host(host)}:{port}",
        flush=True,
    )
    # The engines step in this thread, the one that built and warmed them up; the HTTP
    # server runs in a second one (docs/serving.md, "Threads"). uvicorn handles signals only
    # in the main thread, so they are caught here and passed on: the first one starts its
    # graceful shutdown, a second Ctrl-C forces it.
    caught = []

    def on_signal(signum, frame):
        if signum == signal.SIGINT and signal.SIGINT in caught:
            uv.force_exit = True
        caught.append(signum)
        uv.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    http = threading.Thread(
        target=_serve_http, args=(uv, sock, worker), name="specdec-http", daemon=True
    )
    http.start()
    try:
        worker.run()  # until the HTTP server has shut down (_serve_http stops it)
    finally:
        uv.should_exit = True
        http.join(timeout=args.shutdown_timeout + 30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not uv.started:
        raise SpecdecError(f"the server could not start on {host}:{port} (see the log above)")
    return 130 if signal.SIGINT in caught else 0


def _serve_http(uv, sock, worker):
    """The HTTP server's thread: uvicorn until it has shut down, then the engine loop stops
    (cancelling whatever is still in flight)."""
    try:
        uv.run(sockets=[sock])
    finally:
        worker.request_stop()


def seeded_tree(cost, tree):
    """The fixed tree seeded sampling runs on under an adaptive `tree`: within its bounds, the
    most nodes whose verify the cost model prices at most SEEDED_TREE_COST plain steps (at
    batch 1), so a seeded request decodes about as fast as an adaptive one at light load."""
    from specdec import TreeSpec

    plain = cost.verify(1, 1)
    fits = [n for n in range(2, tree.total + 1) if cost.verify(n, 1) <= SEEDED_TREE_COST * plain]
    total = max(fits, default=2)
    depth, topk = min(tree.depth, total - 1), min(tree.topk, total - 1)
    return TreeSpec.parse(f"dynamic:{depth},{topk},{total}")


def _check_installed():
    missing = [m for m in ("starlette", "uvicorn") if not _importable(m)]
    if missing:
        raise SpecdecError(f"specdec serve needs {', '.join(missing)}: {INSTALL_HINT}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _listening_socket(host: str, port: int) -> socket.socket:
    """Bound now, before the model loads (a taken port fails fast); it listens once served."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidRequestError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise InvalidRequestError(
            f"--host {host} --port {port}: cannot listen there: {e.strerror}"
        ) from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _default_name(model_path: str | None) -> str:
    if model_path is None:
        from specdec.models.loader import default_model_path

        model_path = default_model_path()
    base = os.path.basename(os.path.normpath(model_path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def _draining_uvicorn(config, server):
    """A uvicorn.Server whose shutdown first marks the app as draining (503 to anything new
    that still reaches it)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            server.draining = True
            await super().shutdown(sockets)

    return DrainingServer(config)
