"""The serving stack's private event loop: a server that cannot start fails the caller, it never hangs it."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from serving.router import server_config, start_server
from serving.serve import LoopService


async def app(scope, receive, send) -> None:  # the smallest ASGI app: what is served does not matter here
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def test_a_router_port_in_use_is_a_clear_error_not_an_exit_of_the_loop():
    """uvicorn exits the process (SystemExit) when it cannot bind; inside a task that escaped the loop."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def go():
            await start_server(server_config(app, "127.0.0.1", port))

        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} could not start.*port in use"):
            asyncio.run(go())


class Dying(LoopService):
    """A service whose start kills its loop's thread the way an escaped SystemExit does."""

    async def _start(self, ready_timeout: float) -> None:
        asyncio.get_running_loop().call_soon(self._exit)
        await asyncio.sleep(3600)

    @staticmethod
    def _exit() -> None:
        raise SystemExit(3)

    async def _stop(self) -> None:
        pass


def test_a_caller_waiting_on_a_loop_whose_thread_ended_gets_an_error():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Dying's event loop stopped"):
        Dying().start()
    assert time.monotonic() - t0 < 10


class TimesOut(LoopService):
    """A service whose start gives up the way a replica that never gets healthy does."""

    async def _start(self, ready_timeout: float) -> None:
        await asyncio.sleep(0.1)
        raise TimeoutError("replica did not get healthy")

    async def _stop(self) -> None:
        pass


def test_a_timeout_raised_by_the_coroutine_reaches_the_caller():
    """asyncio's and the future's timeouts are the builtin TimeoutError since Python 3.11: waiting in
    slices must not take the coroutine's own for "not done yet" and wait forever."""
    t0 = time.monotonic()
    svc = TimesOut()
    with pytest.raises(TimeoutError, match="never gets healthy|did not get healthy"):
        svc.start()
    svc.stop()
    assert time.monotonic() - t0 < 10


class _DoneJustAfterTheWait:
    """A future that finishes between the caller's wait slice timing out and its look at done():
    what a loop busy for over a second (a swap, a burst of traffic) makes of any call."""

    def __init__(self) -> None:
        self.waits = 0

    def result(self, timeout=None):
        self.waits += 1
        if self.waits == 1:
            raise TimeoutError()  # the slice ran out; the coroutine finishes right after
        return {"replicas": []}

    def done(self) -> bool:
        return self.waits >= 1

    def cancel(self) -> bool:
        return False


@pytest.mark.parametrize("timeout", [None, 60.0, 0.5])
def test_a_call_that_finishes_as_its_wait_slice_runs_out_returns_its_result(monkeypatch, timeout):
    """It was taken for the coroutine's own TimeoutError (empty message): the demo's alias rollback
    once reported "the pool did not follow" 12 s into a 180 s wait for that reason."""
    import serving.serve as serve

    fut = _DoneJustAfterTheWait()
    monkeypatch.setattr(serve.asyncio, "run_coroutine_threadsafe", lambda coro, loop: (coro.close(), fut)[1])
    svc = TimesOut()

    async def status() -> dict:
        return {"replicas": []}

    try:
        assert svc.run_coro(status(), timeout) == {"replicas": []} and fut.waits == 2
    finally:
        svc.loop.close()  # never started: nothing runs on it
