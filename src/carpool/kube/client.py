"""The one way Carpool reaches the API server: credentials loaded once, JSON in and out.

`Api` speaks plain dicts over the kubernetes client's urllib3 pool (its TLS, token refresh
and exec plugins) but not its generated API classes: those validate and serialize every
argument in Python, ~10 ms of CPU per call (measured: 110 pod creates/s with 32 threads
through `CoreV1Api`, 530/s through the same pool directly). Errors come back as the types in
`carpool.kube.errors`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import orjson
import urllib3
from kubernetes import client, config

from carpool.kube.errors import ApiError, NotFound, Unreachable

Obj = dict[str, Any]
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
# (connect, read) seconds for every call: an API server that accepts a request and never
# answers must not stall its caller; the call fails and the caller's next round retries it.
REQUEST_TIMEOUT = (5.0, 120.0)
LIST_PAGE = 500


def load_configuration(kubeconfig: str | Path | None = None,
                       context: str | None = None) -> client.Configuration:
    """`kubeconfig` (with `context`) when given; else the pod's service account when running
    in a cluster; else $KUBECONFIG or ~/.kube/config. Raises ValueError when none works."""
    configuration = client.Configuration()
    try:
        if kubeconfig is not None or context is not None:
            config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None,
                                    context=context, client_configuration=configuration)
            return configuration
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    except Exception as err:  # ConfigException, OSError, a kubeconfig that is not YAML, ...
        raise ValueError(f"no cluster to talk to: {err} (pass a kubeconfig or set "
                         f"KUBECONFIG)") from None
    return configuration


def kubeconfig_namespace(kubeconfig: str | Path | None = None,
                         context: str | None = None) -> str:
    """The namespace the kubeconfig's (current or given) context names; 'default' if none."""
    try:
        contexts, active = config.list_kube_config_contexts(
            config_file=str(kubeconfig) if kubeconfig else None)
    except (config.ConfigException, OSError):
        return "default"
    if context:
        active = next((c for c in contexts if c.get("name") == context), active)
    return str((active or {}).get("context", {}).get("namespace") or "default")


class Api:
    """JSON requests to one API server, through one connection pool."""

    def __init__(self, configuration: client.Configuration, *, pool_size: int | None = 16,
                 user_agent: str = "carpool") -> None:
        if pool_size is not None:
            configuration.connection_pool_maxsize = pool_size
        self.configuration = configuration
        self.client = client.ApiClient(configuration)
        self.pool: urllib3.PoolManager = self.client.rest_client.pool_manager
        self.host = str(configuration.host).rstrip("/")
        self.user_agent = user_agent
        self.writes = 0  # requests other than GET so far (the operator logs them per pass)
        self._count = threading.Lock()

    @classmethod
    def load(cls, kubeconfig: str | Path | None = None, *, context: str | None = None,
             pool_size: int = 16, user_agent: str = "carpool") -> Api:
        """An `Api` for the cluster `load_configuration` finds."""
        return cls(load_configuration(kubeconfig, context), pool_size=pool_size,
                   user_agent=user_agent)

    @classmethod
    def of(cls, api: Api | Any) -> Api:
        """`api` itself, or an `Api` on the credentials of a kubernetes `ApiClient` (tests and
        scripts that hold one)."""
        return api if isinstance(api, Api) else cls(api.configuration, pool_size=None)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": JSON, "User-Agent": self.user_agent}
        if content_type:
            headers["Content-Type"] = content_type
        # refreshes an expiring token (in-cluster service account, exec plugins)
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        return headers

    def url(self, path: str, query: dict[str, Any] | None = None) -> str:
        return self.host + path + (f"?{urlencode(query)}" if query else "")

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = JSON, query: dict[str, Any] | None = None,
                timeout: tuple[float, float] = REQUEST_TIMEOUT) -> Obj:
        """The decoded answer ({} when empty); an `ApiError` for 4xx/5xx or no answer."""
        payload = None if body is None else (
            body if isinstance(body, bytes) else json.dumps(body).encode())
        if method != "GET":
            with self._count:
                self.writes += 1
        try:
            response = self.pool.request(
                method, self.url(path, query), body=payload,
                headers=self.headers(content_type if payload is not None else None),
                timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]), retries=False,
                preload_content=True)
        except urllib3.exceptions.HTTPError as err:
            raise Unreachable(f"API server not reached: {err}") from None
        if response.status >= 400:
            raise ApiError.of(response.status, response.reason or "",
                              response.data.decode("utf-8", "replace"))
        return dict(orjson.loads(response.data)) if response.data else {}

    def get(self, path: str, query: dict[str, Any] | None = None) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path, query=query)
        except NotFound:
            return None

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Obj, content_type: str = MERGE_PATCH,
              query: dict[str, Any] | None = None) -> Obj:
        return self.request("PATCH", path, body, content_type=content_type, query=query)

    def apply(self, path: str, body: Obj, field_manager: str) -> Obj:
        """Server-side apply, taking over fields from other managers."""
        return self.request("PATCH", path, body, content_type=APPLY_PATCH,
                            query={"fieldManager": field_manager, "force": "true"})

    def delete(self, path: str, query: dict[str, Any] | None = None) -> Obj | None:
        """The API server's answer (the object while it is being deleted); None if gone."""
        try:
            return self.request("DELETE", path, query=query)
        except NotFound:
            return None

    def list_all(self, path: str, query: dict[str, Any] | None = None) -> tuple[list[Obj], str]:
        """Every item (in pages of LIST_PAGE) and the list's resourceVersion."""
        items: list[Obj] = []
        params = dict(query or {}, limit=LIST_PAGE)
        while True:
            page = self.request("GET", path, query=params)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion", ""))
            params["continue"] = meta["continue"]

    def stream(self, path: str, query: dict[str, Any], read_timeout: float) -> Any:
        """An unread streaming response (a watch); the caller reads and releases it."""
        try:
            response = self.pool.request(
                "GET", self.url(path, query), headers=self.headers(),
                timeout=urllib3.Timeout(connect=REQUEST_TIMEOUT[0], read=read_timeout),
                retries=False, preload_content=False)
        except urllib3.exceptions.HTTPError as err:
            raise Unreachable(f"API server not reached: {err}") from None
        if response.status >= 400:
            body = response.data.decode("utf-8", "replace")
            response.release_conn()
            raise ApiError.of(response.status, response.reason or "", body)
        return response


def generated_client(kubeconfig: str | Path | None = None) -> Any:
    """The kubernetes package's own `ApiClient` (for tests and scripts that use its typed
    API classes; Carpool itself speaks through `Api`)."""
    return client.ApiClient(load_configuration(kubeconfig))
