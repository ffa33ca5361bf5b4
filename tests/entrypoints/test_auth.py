"""The API key check `kvrelay serve` and `kvrelay proxy` share: which routes it guards, and its
401 in OpenAI's error shape."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvrelay.entrypoints.auth import RequireAPIKey, api_key_error


def test_the_header_must_be_bearer_and_the_exact_key() -> None:
    assert api_key_error("Bearer sekret", "sekret") is None
    assert api_key_error("bearer  sekret ", "sekret") is None
    assert "missing API key" in (api_key_error("", "sekret") or "")
    for wrong in ("Bearer nope", "Basic sekret", "sekret", "Bearer sekret2"):
        assert "incorrect API key" in (api_key_error(wrong, "sekret") or ""), wrong


def test_the_middleware_guards_every_route_but_health_metrics_and_the_admin_api() -> None:
    app = FastAPI()
    for path in ("/v1/completions", "/health", "/metrics", "/admin/instances", "/tokenize"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    client = TestClient(RequireAPIKey(app, "sekret"))
    refused = client.post("/v1/completions")
    assert refused.status_code == 401
    assert refused.json() == {"error": {"message": "missing API key: send the header 'Authorization: Bearer "
                                                   "<key>'", "type": "AuthenticationError", "param": None,
                                        "code": 401}}
    assert client.get("/tokenize", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/v1/completions", headers={"Authorization": "Bearer sekret"}).json() == {"ok": True}
    for open_path in ("/health", "/metrics", "/admin/instances"):
        assert client.get(open_path).status_code == 200, open_path
