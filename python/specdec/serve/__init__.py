"""`specdec serve`: an OpenAI-compatible HTTP server on the online engine (docs/serving.md).

    protocol.py     request bodies -> checked GenerationRequests (or OpenAI-style 4xx errors)
    worker.py       the engines' step loop, alone in its thread; submit / cancel through a queue
    app.py          the ASGI app (Starlette): routes, admission, streaming, disconnects
    responses.py    OpenAI response bodies and server-sent event chunks
    text_stream.py  a reply's text as its tokens arrive (deltas that are never taken back)
    metrics.py      Prometheus counters, gauges and histograms (GET /metrics)
    errors.py       APIError: an HTTP status with an OpenAI-style error body
    command.py      the subcommand: flags, building the engines, uvicorn, SIGTERM

Needs the `serve` extra (pip install 'specdec[serve]'); nothing else in specdec imports it.
"""
