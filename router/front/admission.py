"""What the router changes in a client's request before any worker sees it.

- `kv_transfer_params`: filtered to what a client may set (`router/front/kv_params.py`: `restore`);
  a malformed `restore` is a 400.
- `cache_salt` (with API keys): the tenant's own (`router.tenants.ApiKeys.cache_salt`, keyed
  by a secret no tenant holds) replaces the client's, so no tenant can read another's prefix
  cache or stored blocks, nor poison them. Without keys there is one tenant, and a client's
  salt is passed on as given.
- stop strings of a resumable stream: workers are asked for `include_stop_str_in_output`, and
  the router holds text back and drops the stop string itself (`router/streaming/stops.py`),
  so a resumed stream loses nothing and misses no stop string that spans the break.
"""

from __future__ import annotations

from dataclasses import replace

from router.front.api import ClientRequest
from router.front.kv_params import KV_PARAMS_FIELD, client_kv_params
from router.streaming.stops import stop_strings
from router.tenants import ApiKeys

__all__ = ["admit"]


def admit(creq: ClientRequest, tenant: str, *, keys: ApiKeys | None) -> ClientRequest:
    """`creq` as the router sends it on for `tenant` (see the module docstring). `keys`: the
    router's API keys (with any, it has tenants and sets each one's cache salt)."""
    body = dict(creq.body)
    params = client_kv_params(body.pop(KV_PARAMS_FIELD, None), strict=True)
    if params:
        body[KV_PARAMS_FIELD] = params
    if keys:
        salt: str | None = keys.cache_salt(tenant)
        body["cache_salt"] = salt
    else:
        given = body.get("cache_salt")
        salt = given if isinstance(given, str) and given else None
    strip_stops = False
    if creq.stream and creq.resumable and stop_strings(body) \
            and not body.get("include_stop_str_in_output"):
        body["include_stop_str_in_output"] = True
        strip_stops = True
    return replace(creq, body=body, tenant=tenant, cache_salt=salt, strip_stops=strip_stops)
