"""The engines' step loop, alone in its thread: the one place where engines are called.

The Engine is not thread-safe (specdec.engine), so the HTTP side never touches it: it puts
commands (submit, cancel, stop) on a thread-safe queue, and the loop runs them between steps,
steps every engine that has work, and hands each request's progress to the listener given at
submission (called from the loop's thread: the HTTP side moves it onto its event loop).

    worker = EngineWorker({"main": engine}, metrics)
    # HTTP thread:
    worker.submit(Request(ids, params, id="chatcmpl-1"), "main", listener)  # listener(Update)
    worker.cancel("chatcmpl-1")      # a client went away: its cache rows are freed
    worker.request_stop()            # unfinished requests end as "cancelled"
    # the thread that built the engines (`specdec serve`: the main thread):
    worker.run()                     # returns once stopped

`specdec serve` runs the loop in the thread that built and warmed up the engines, the HTTP
server in another (docs/serving.md, "Threads"); start() / stop() run it in a thread of its
own instead. Idle, the loop blocks on the queue (no polling); busy, it drains the queue
without waiting before each round of steps.
"""

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from specdec import InvalidRequestError, Request, Result

log = logging.getLogger("specdec.serve")


@dataclass
class Update:
    """A request's progress after a step: the tokens it gained, and its Result once finished
    (finish_reason "cancelled" when it was withdrawn). error: the request could not run
    (status 400: the engine refused it; 500: the engine failed)."""

    tokens: list
    result: Result | None = None
    error: str | None = None
    status: int = 500


@dataclass(eq=False)
class _InFlight:
    lane: str
    handle: object  # specdec.engine.RequestHandle
    listener: Callable[[Update], None]


_STOP = object()


class EngineWorker:
    """engines: {lane: Engine}, built on one model; all of them are stepped by this thread.
    metrics: a specdec.serve.metrics.Metrics (steps, finished requests, rows in use)."""

    def __init__(self, engines: dict, metrics=None):
        self.engines = dict(engines)
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[object, _InFlight] = {}
        self._finished: list = []  # Results the engines reported during the current command/step
        self._thread: threading.Thread | None = None
        self._ended = False  # the loop returned: nothing is served any more

    # ------------------------------------------------------------------ the loop's thread
    def run(self) -> None:
        """The step loop, in the calling thread, until request_stop() (which cancels whatever
        is in flight)."""
        try:
            self._run()
        finally:
            self._ended = True

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        """run() in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, lane: str, listener: Callable[[Update], None]) -> None:
        """Queues request (its id unique among those in flight) on engine `lane`."""
        self._commands.put(("submit", request, lane, listener))

    def cancel(self, request_id) -> None:
        """Withdraws a request if it has not finished (its listener gets a "cancelled" Result)."""
        self._commands.put(("cancel", request_id))

    def request_stop(self) -> None:
        """Asks the loop to cancel whatever is in flight and return (without waiting)."""
        self._commands.put(_STOP)

    def stop(self, timeout: float | None = None) -> bool:
        """request_stop(), then waits for start()'s thread -> whether it ended in time."""
        self.request_stop()
        if self._thread is None:
            return self._ended
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether requests are served: the loop runs, or will (it has not ended)."""
        return not self._ended

    # ------------------------------------------------------------------ the loop
    def _run(self):
        try:
            while True:
                busy = any(e.has_work for e in self.engines.values())
                try:  # idle: sleep until a command comes; busy: only what is already queued
                    command = self._commands.get(block=not busy)
                except queue.Empty:
                    command = None
                while command is not None:
                    if command is _STOP:
                        self._cancel_all()
                        return
                    self._run_command(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                for lane, engine in self.engines.items():
                    if engine.has_work:
                        self._step(lane, engine)
                self._publish()
        except BaseException:  # a bug here must not leave every client waiting forever
            log.error("the engine loop failed:\n%s", traceback.format_exc())
            self._ended = True
            self._fail_all("the engine loop failed; see the server log", 500)
            raise

    def _run_command(self, command):
        kind = command[0]
        if kind == "submit":
            _, request, lane, listener = command
            try:
                handle = self.engines[lane].submit(request, on_finish=self._finished.append)
            except InvalidRequestError as e:
                _deliver(listener, Update([], None, str(e), 400))
                return
            except Exception as e:  # the engine's own failure, not the request's
                log.error("submit failed:\n%s", traceback.format_exc())
                _deliver(listener, Update([], None, f"{type(e).__name__}: {e}", 500))
                return
            self._in_flight[request.id] = _InFlight(lane, handle, listener)
        elif kind == "cancel":
            record = self._in_flight.get(command[1])
            if record is not None:
                record.handle.cancel()  # on_finish -> self._finished
                self._deliver_finished({})
        self._publish()

    def _step(self, lane: str, engine):
        start = time.perf_counter()
        rows = engine.num_active + min(engine.num_queued, engine.batch_size - engine.num_active)
        try:
            # First tokens go out as soon as their prefill is done, not after the verify round
            # of the whole batch that step() runs next.
            self._deliver_finished(engine.admit())
            gained = engine.step()
        except Exception as e:
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_lane(lane, f"the engine failed: {type(e).__name__}: {e}")
            return
        if self.metrics is not None:
            self.metrics.observe_step(lane, time.perf_counter() - start, rows)
        self._deliver_finished(gained)

    def _deliver_finished(self, gained: dict):
        """Tokens gained and the Results reported since the last call, one Update per request
        (a request that finished in this step gets its last tokens and its Result together)."""
        results = {r.request_id: r for r in self._finished}
        self._finished.clear()
        for request_id in set(gained) | set(results):
            result = results.get(request_id)
            record = (
                self._in_flight.pop(request_id, None)
                if result is not None
                else self._in_flight.get(request_id)
            )
            if record is None:
                continue
            if result is not None and self.metrics is not None:
                self.metrics.observe_result(result)
            _deliver(record.listener, Update(gained.get(request_id, []), result))

    def _cancel_all(self):
        for record in list(self._in_flight.values()):
            try:
                record.handle.cancel()
            except Exception:
                log.error("cancel failed:\n%s", traceback.format_exc())
        self._deliver_finished({})
        self._fail_all("the server is shutting down", 503)
        self._publish()

    def _fail_lane(self, lane: str, message: str):
        """After a failed step: every request of the lane is withdrawn and told why."""
        for request_id, record in list(self._in_flight.items()):
            if record.lane != lane:
                continue
            try:
                record.handle.cancel()
            except Exception:
                pass
            del self._in_flight[request_id]
            _deliver(record.listener, Update([], None, message, 500))
        self._finished.clear()

    def _fail_all(self, message: str, status: int):
        for record in self._in_flight.values():
            _deliver(record.listener, Update([], None, message, status))
        self._in_flight.clear()

    def _publish(self):
        if self.metrics is not None:
            self.metrics.set_engine_state(self.engines)


def _deliver(listener, update: Update):
    try:
        listener(update)
    except Exception:  # a listener's failure (its event loop closed) is the HTTP side's
        log.debug("listener failed:\n%s", traceback.format_exc())
