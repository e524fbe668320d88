"""Fuzzing the router's HTTP API (hypothesis): no crash, OpenAI-style errors, right codes."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.local.services import free_port
from router.config import RouterConfig, StaticWorker
from router.membership.workers import WorkerId
from tests.router_harness import FakeWorker, RouterHandle, loop_thread, wait_until

MODEL = "fake"
MAX_BODY = 16 << 10
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with loop_thread() as lt:
        fake = FakeWorker(MODEL)
        lt.run(fake.start())
        config = RouterConfig(port=free_port(), max_body_bytes=MAX_BODY, static_ttl_s=2.0,
                              static_workers=(StaticWorker(WorkerId("f"), fake.url),))
        router = RouterHandle(lt, config).start()
        client = httpx.Client(base_url=router.url, timeout=30)
        wait_until(lambda: client.get("/v1/models").json()["data"] != [])
        yield client
        client.close()
        router.stop()
        lt.run(fake.stop())


def check_error(r: httpx.Response) -> None:
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["code"] == r.status_code


json_scalars = st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(
    allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=8), c, max_size=4), max_leaves=12)
session_ids = st.none() | st.text(string.printable, max_size=140) | st.integers()
prompts = (st.text(max_size=200) | st.lists(st.integers(0, 998), min_size=1, max_size=50)
           | st.lists(st.text(max_size=10), min_size=1, max_size=3) | json_values)


@FUZZ
@given(raw=st.binary(max_size=2048))
def test_random_bytes(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        check_error(r)


@FUZZ
@given(model=st.sampled_from([MODEL, "other", ""]) | json_scalars, prompt=prompts,
       stream=st.none() | st.booleans() | json_scalars, n=st.none() | st.integers(-1, 3),
       max_tokens=st.none() | st.integers(-2, 30) | st.text(max_size=3),
       # Stripped: HTTP clients refuse to send a header value with outer whitespace at all.
       session=session_ids, header=st.none() | st.text(string.ascii_letters + string.digits
                                                       + "._:-/ ", max_size=140).map(str.strip),
       extra=st.dictionaries(st.text(max_size=10), json_values, max_size=3),
       chat=st.booleans())
def test_structured_requests(http: httpx.Client, model: Any, prompt: Any, stream: Any, n: Any,
                             max_tokens: Any, session: Any, header: str | None,
                             extra: dict[str, Any], chat: bool) -> None:
    body: dict[str, Any] = {**extra, "model": model, "stream": stream, "n": n,
                            "max_tokens": max_tokens}
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) else [
            {"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if session is not None:
        body["session_id"] = session
    headers = {"X-Session-Id": header} if header is not None else {}
    r = http.post("/v1/chat/completions" if chat else "/v1/completions",
                  content=json.dumps(body), headers=headers)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        check_error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")


@FUZZ
@given(size=st.integers(MAX_BODY + 1, MAX_BODY * 4), declared=st.booleans())
def test_huge_bodies(http: httpx.Client, size: int, declared: bool) -> None:
    payload = b'{"model":"fake","prompt":"' + b"x" * size + b'"}'
    if declared:
        r = http.post("/v1/completions", content=payload)
    else:  # chunked: no Content-Length to reject early
        r = http.post("/v1/completions", content=iter([payload[:100], payload[100:]]))
    assert r.status_code == 413
    check_error(r)


@FUZZ
@given(path=st.text(string.ascii_letters + string.digits + "/._-", max_size=40),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       headers=st.dictionaries(st.sampled_from(["X-Session-Id", "Content-Type",
                                                "Authorization", "X-Odd", "Accept"]),
                               st.text(string.printable.strip(), max_size=60), max_size=4))
def test_odd_paths_methods_headers(http: httpx.Client, path: str, method: str,
                                   headers: dict[str, str]) -> None:
    r = http.request(method, "/" + path.lstrip("/"), headers=headers,
                     content=b'{"model":"fake","prompt":"hi","max_tokens":2}')
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        check_error(r)


def test_still_healthy_after_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health").json()["workers"]["usable"] == 1
    metrics = http.get("/metrics").text
    assert 'status="500"' not in metrics
