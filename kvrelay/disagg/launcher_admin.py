"""`kvrelay up --admin`: the cluster's admin endpoint, which also starts and stops instances.

It speaks the proxy's admin API (kvrelay/disagg/admin.py) with the same key, and adds what only
the launcher can do:

    POST /admin/instances {"role": "decode"}   no "url": start a new `kvrelay serve` of that role
                                               (the cluster's model, connector and flags), wait
                                               until it is healthy, add it to the proxy's pool
    POST /admin/instances/drain {"url": ...}   drain it in the proxy; once the proxy has let it
                                               go, stop its process if the launcher started it

Every other request goes to the proxy's admin API unchanged. A stdlib HTTP server in a daemon
thread: the launcher's main thread keeps watching its children.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from kvrelay.disagg.launcher import ChildProcess, ClusterError, LocalCluster

logger = logging.getLogger(__name__)

_MAX_BODY = 1 << 20
_DRAIN_POLL_S = 0.5


class LauncherAdmin:
    def __init__(self, cluster: LocalCluster, admin_key: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cluster = cluster
        self.admin_key = admin_key
        self._stopping = threading.Event()
        # NOTE: children start from this one long-lived thread. A child dies with the *thread*
        # that started it (PR_SET_PDEATHSIG), and each request's thread ends with the request.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-up-spawner")
        admin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._answer(*admin.handle("GET", self.path, self.headers.get("Authorization", ""), b""))

            def do_POST(self) -> None:  # noqa: N802
                length = min(int(self.headers.get("Content-Length") or 0), _MAX_BODY)
                body = self.rfile.read(length)
                self._answer(*admin.handle("POST", self.path, self.headers.get("Authorization", ""), body))

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("admin: " + format, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvrelay-up-admin",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self._spawner.shutdown(wait=False)

    # ------------------------------------------------------------------ requests

    def handle(self, method: str, path: str, authorization: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        denied = self._check_key(authorization)
        if denied is not None:
            return denied
        body: Any = None
        if method == "POST":
            try:
                body = json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return _error(400, f"request body is not valid JSON: {e}")
        if method == "POST" and path == "/admin/instances" and isinstance(body, dict) and "url" not in body:
            return self._start_and_add(body)
        status, answer = self._forward(method, path, body)
        if method == "POST" and path == "/admin/instances/drain" and status == 202 and isinstance(body, dict):
            child = self.cluster.find(str(body.get("url", "")))
            if child is not None:
                answer["stops_process"] = True
                threading.Thread(target=self._stop_when_released, args=(child,), daemon=True).start()
        return status, answer

    def _check_key(self, authorization: str) -> tuple[int, dict[str, Any]] | None:
        scheme, _, token = authorization.partition(" ")
        if not scheme:
            return _error(401, "missing admin key: send 'Authorization: Bearer <admin key>'")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.admin_key):
            return _error(401, "incorrect admin key")
        return None

    def _start_and_add(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        role = body.get("role")
        if role not in ("prefill", "decode"):
            return _error(400, f"role must be one of prefill, decode, got {role!r}")
        try:
            child = self._spawner.submit(self.cluster.start_instance, role).result()
        except ClusterError as e:
            return _error(502, f"the new {role} instance did not start: {e}")
        request = {**body, "url": child.url}
        if role == "prefill" and self.cluster.spec.connector == "NixlPushConnector":
            request["kv_address"] = self.cluster.kv_addresses[child.name]  # D registers with P there
        status, answer = self._forward("POST", "/admin/instances", request)
        if status != 201:  # the proxy refused it: do not leave it running
            self.cluster.stop_instance(child)
        else:
            answer["started"] = {"name": child.name, "pid": child.pid, "log": str(child.log_path)}
        return status, answer

    def _forward(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        try:
            response = httpx.request(method, self.cluster.url + path, json=body, timeout=600, trust_env=False,
                                     headers={"Authorization": f"Bearer {self.admin_key}"})
            answer = response.json()
        except (httpx.HTTPError, ValueError) as e:
            return _error(502, f"the proxy at {self.cluster.url} did not answer: {e!r}")
        return response.status_code, answer if isinstance(answer, dict) else {"answer": answer}

    def _stop_when_released(self, child: ChildProcess) -> None:
        """Stop a drained instance's process once the proxy no longer lists it."""
        while not self._stopping.is_set():
            status, answer = self._forward("GET", "/admin/instances", None)
            listed = {i.get("url") for i in answer.get("instances", [])} if status == 200 else {child.url}
            if child.url not in listed:
                logger.info("%s left the pool: stopping it", child.name)
                self.cluster.stop_instance(child)
                return
            time.sleep(_DRAIN_POLL_S)


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "AdminError", "param": None, "code": status}}
