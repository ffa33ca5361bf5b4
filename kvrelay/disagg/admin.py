"""The proxy's admin API: list, add and drain instances of a running pool.

    GET  /admin/instances         {"instances": [...], "routing": {"prefill": ..., "decode": ...}}
    POST /admin/instances         {"role": "prefill"|"decode", "url": "http://host:port",
                                   "kv_address": "host:port" (push clusters, prefill only),
                                   "kv_events": {"endpoint", "replay_endpoint", "topic"} (optional:
                                   kvrelay instances say it themselves)}  -> 201 {"instance": {...}}
    POST /admin/instances/drain   {"url": ..., "force": false}            -> 202 {"instance": {...}}

Every route needs `Authorization: Bearer <admin key>` (`--admin-key` or KVRELAY_ADMIN_KEY); with
no key set, the admin API is off (403). Errors are OpenAI-shaped and name the problem:
400 bad body, role, URL or address; 401 missing or wrong key; 404 unknown instance; 409 already
a member, already draining, the last active instance of its role (pass "force": true), or an
instance whose transfer mode is not the proxy's; 502 the instance does not answer its health
check.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvrelay.disagg.backends import ROLES, check_url
from kvrelay.disagg.instance_info import TransferModeError
from kvrelay.disagg.pool_manager import PoolManager
from kvrelay.disagg.push_mode import parse_kv_address
from kvrelay.entrypoints.openai_errors import error_response
from kvrelay.kv_events.subscriber import StreamAddress

_ADD_KEYS = {"role", "url", "kv_address", "kv_events"}
_DRAIN_KEYS = {"url", "force"}
_EVENT_KEYS = {"endpoint", "replay_endpoint", "topic"}


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class AdminAPI:
    def __init__(self, manager: PoolManager, admin_key: str | None) -> None:
        self.manager = manager
        self.admin_key = admin_key

    def check_key(self, request: Request) -> None:
        if self.admin_key is None:
            raise AdminError(403, "the admin API is off: start the proxy with --admin-key "
                                  "(or KVRELAY_ADMIN_KEY set)")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not scheme:
            raise AdminError(401, "missing admin key: send 'Authorization: Bearer <admin key>'")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.admin_key):
            raise AdminError(401, "incorrect admin key")

    def list(self) -> dict[str, Any]:
        return {"instances": [self.manager.describe(b) for b in self.manager.members()],
                "routing": {role: pool.policy.name for role, pool in self.manager.pools.items()}}

    async def add(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown(body, _ADD_KEYS)
        role = body.get("role")
        if role not in ROLES:
            raise AdminError(400, f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "prefill" and self.manager.config.aggregated:
            raise AdminError(400, "this proxy serves without P/D (it started with no prefill instance): "
                                  "add decode instances, each serves whole requests")
        try:
            url = check_url(role, body.get("url"))  # type: ignore[arg-type]
        except ValueError as e:
            raise AdminError(400, str(e)) from None
        kv_address = self._kv_address(role, body.get("kv_address"))
        events = _events(body.get("kv_events"))
        try:
            backend = await self.manager.add(role, url, kv_address, events)
        except KeyError as e:
            raise AdminError(409, str(e.args[0])) from None
        except TransferModeError as e:
            raise AdminError(409, str(e)) from None
        except ConnectionError as e:
            raise AdminError(502, str(e)) from None
        return {"instance": self.manager.describe(backend)}

    def drain(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown(body, _DRAIN_KEYS)
        url, force = body.get("url"), body.get("force", False)
        if not isinstance(url, str) or not url:
            raise AdminError(400, f"url must be the instance's base URL, got {url!r}")
        if not isinstance(force, bool):
            raise AdminError(400, f"force must be true or false, got {force!r}")
        try:
            backend = self.manager.drain(url, force)
        except KeyError as e:
            raise AdminError(404, str(e.args[0])) from None
        except ValueError as e:
            raise AdminError(409, str(e)) from None
        return {"instance": self.manager.describe(backend)}

    def _kv_address(self, role: str, value: Any) -> tuple[str, int] | None:
        push = self.manager.config.transfer_mode == "push"
        if value is None:
            if push and role == "prefill":
                raise AdminError(400, "this proxy runs push mode: a prefill instance needs its kv_address "
                                      "(its KV side channel, host:port)")
            return None
        if not push or role != "prefill":
            raise AdminError(400, "kv_address is only for prefill instances of a push-mode proxy")
        try:
            return parse_kv_address(value if isinstance(value, str) else repr(value))
        except ValueError as e:
            raise AdminError(400, str(e)) from None


def _refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise AdminError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(sorted(known))}")


def _events(value: Any) -> StreamAddress | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("endpoint"), str):
        raise AdminError(400, "kv_events must be an object with at least an endpoint (a ZeroMQ address "
                              f"like tcp://host:5557), got {value!r}")
    _refuse_unknown(value, _EVENT_KEYS)
    replay, topic = value.get("replay_endpoint"), value.get("topic", "")
    for name, item in (("endpoint", value["endpoint"]), ("replay_endpoint", replay)):
        if item is not None and (not isinstance(item, str) or "://" not in item):
            raise AdminError(400, f"kv_events {name} must be a ZeroMQ address like tcp://host:5557, "
                                  f"got {item!r}")
    if not isinstance(topic, str):
        raise AdminError(400, f"kv_events topic must be a string, got {topic!r}")
    return StreamAddress(value["endpoint"], replay, topic)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdminError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise AdminError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def add_admin_routes(app: FastAPI, api: AdminAPI) -> None:
    @app.exception_handler(AdminError)
    async def on_admin_error(_: Request, e: AdminError) -> JSONResponse:
        return error_response(e.status, e.message)

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> JSONResponse:
        api.check_key(request)
        return JSONResponse(api.list())

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> JSONResponse:
        api.check_key(request)
        return JSONResponse(await api.add(await _json_object(request)), status_code=201)

    @app.post("/admin/instances/drain")
    async def drain_instance(request: Request) -> JSONResponse:
        api.check_key(request)
        return JSONResponse(api.drain(await _json_object(request)), status_code=202)
