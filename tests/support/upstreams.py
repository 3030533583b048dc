"""Stand-in HTTP upstreams for the proxy's and the soak client's unit tests."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def serve(app: web.Application, **runner_kw: Any) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free loopback port: its runner (the caller cleans it up) and
    its URL; ``runner_kw``: for :class:`aiohttp.web.AppRunner`."""
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
