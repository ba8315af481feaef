"""A metaserver stand-in on 127.0.0.1, or another address of this host (a namespace host's, when
made in it), on its own aiohttp loop thread, for the decoder-side tests."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from lw_bench.pd.stack import free_port


class FakeMetaserver:
    """``mode``: "ok" (200), "error" (502 with a JSON error), "silent" (holds the POST forever),
    "bad-body" (200 with a body that is not the wire struct), "held" (holds the POST until the
    next ``release()``, then answers as the mode set then says, 200 if it is still "held": a proxy
    answering once its prefill is done; ``close`` releases too). A request for any other path or
    method is answered 200 and listed in ``stray`` ("METHOD /path"): a URL the engine must not call."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        """``port``: a fixed one (another host's namespace, where its engines were told which
        metaservers they may call: pd_allowed_metaservers); a free one by default."""
        self.mode = "ok"
        self.answer: dict = {"status": "ok"}  # the body of a 200 answer (a proxy's may carry a first token)
        self.host = host
        self.bodies: list[dict] = []
        self.stray: list[str] = []
        self.cancelled = 0
        # Which requests' POSTs were cancelled: a module-scoped server still holds POSTs of earlier
        # tests whose cancellations can arrive late, so tests check their own request ids.
        self.cancelled_ids: list[str] = []
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}/v1/metaserver"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._released: asyncio.Event | None = None  # made on the loop
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake metaserver did not start"

    async def _handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.bodies.append(body)
        mode = self.mode
        if mode == "held":
            assert self._released is not None
            await self._released.wait()
            mode = "ok" if self.mode == "held" else self.mode
        if mode == "ok":
            return web.json_response(self.answer)
        if mode == "bad-body":
            return web.json_response({"status": "maybe"})
        if mode == "error":
            return web.json_response({"error": {"message": "prefill failed", "type": "upstream_error",
                                                "param": None, "code": 502}}, status=502)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_ids.append(body.get("request_id"))
            raise
        raise AssertionError("unreachable")

    async def _stray(self, request: web.Request) -> web.Response:
        self.stray.append(f"{request.method} {request.path}")
        return web.json_response({"status": "ok"})

    def release(self) -> None:
        """Answer the POSTs held in mode "held"; later ones are held until the next release."""

        def now() -> None:
            held, self._released = self._released, asyncio.Event()
            if held is not None:
                held.set()

        self._loop.call_soon_threadsafe(now)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._released = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/metaserver", self._handle)
        app.router.add_route("*", "/{tail:.*}", self._stray)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        self.release()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
