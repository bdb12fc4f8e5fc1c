"""What the hostile-client test modules share: a module's `server` fixture is checked after every
probe (no KV block held, the same greedy reference text), and error responses are checked for
OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_process import ServerProcess

REFERENCE = {"prompt": "The reference prompt", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> str:
    return reference_text(server)


@pytest.fixture(autouse=True)
def server_stays_whole(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each probe of the module's shared server: no KV block held, and the same greedy text."""
    if "server" not in request.fixturenames:
        yield
        return
    expected = request.getfixturevalue("reference")  # taken before the first probe
    yield
    srv: ServerProcess = request.getfixturevalue("server")
    srv.wait_blocks_free(timeout=15)
    assert reference_text(srv) == expected


def reference_text(srv: ServerProcess) -> str:
    r = httpx.post(f"{srv.base_url}/completions", json=REFERENCE, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The error of an OpenAI-style error response with this status."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    return err
