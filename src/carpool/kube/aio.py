"""Requests on the caller's asyncio event loop (aiohttp), with the same credentials as `Api`.

The extender binds a hundred pods a second from its event loop: blocking calls need a thread
each, and those threads contended for the interpreter with filter and prioritize, each call
costing more CPU than the request itself.
"""

from __future__ import annotations

import ssl

import aiohttp

from carpool.kube.client import JSON, Api
from carpool.kube.errors import ApiError, Unreachable


class AioApi:
    """One aiohttp session per process, made on first use (inside the running loop)."""

    def __init__(self, api: Api, *, connections: int = 64, timeout_s: float = 10.0) -> None:
        self.api = api
        self.connections = connections
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            cfg = self.api.configuration
            tls: ssl.SSLContext | bool = False
            if str(cfg.host).startswith("https"):
                tls = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
                if not cfg.verify_ssl:
                    tls.check_hostname = False
                    tls.verify_mode = ssl.CERT_NONE
                if cfg.cert_file:
                    tls.load_cert_chain(cfg.cert_file, cfg.key_file)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=tls, limit=self.connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def request(self, method: str, path: str, body: bytes | None = None,
                      content_type: str = JSON) -> None:
        """Send `body` (already encoded); an `ApiError` for 4xx/5xx or no answer. The
        answer's body is not decoded (the callers need only whether it worked)."""
        try:
            async with self._http().request(method, self.api.url(path), data=body,
                                            headers=self.api.headers(content_type)) as resp:
                if resp.status < 300:
                    return
                text = await resp.text()
                status, reason = resp.status, resp.reason or ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unreachable(f"API server not reached: {exc}") from None
        raise ApiError.of(status, reason, text)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
