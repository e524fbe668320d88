"""Rendering a new turn as the continuation of a conversation's token ids, with the worker's
own tokenizer and chat template (vLLM's `/tokenize`: the router holds neither).

Chat. The template decides what comes between the end of the last answer and the new turn's
generation prompt (an end-of-turn marker, the next role's header, ...). It is found by
rendering a probe conversation twice: ending open right after an assistant message's content
(`continue_final_message`), and with the new messages after that assistant message. When the
first rendering is a token prefix of the second, the rest is the new turn exactly as a
full-history request would render it, seam included; the conversation's ids (which end with
the last answer's content tokens) plus that rest is the prompt. The open rendering does not
depend on the new turn and is cached per model and template arguments (a digest of them: the
arguments are the client's, `tools` may be large), least recently used first out past
`OPEN_CACHE_ENTRIES`, so clients varying them cost the router a bounded cache (trust-review
L4). A worker's `/tokenize` answer is read up to `TOKENIZE_MAX_BYTES`; a longer one is that
worker's failure (another is asked). A template for which
the prefix property fails (one that renders earlier turns differently once a later one
follows, say) cannot be continued this way: `ContinuationUnsupported`, never a guess.

Completions. The new text is tokenized without special tokens and appended (a token-id prompt
is appended as is).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import aiohttp

from router.errors import BadRequest, ContinuationUnsupported, UpstreamTooLarge
from router.front.upstream import UPSTREAM_ERRORS
from router.limits import TOKENIZE_MAX_BYTES, read_capped

__all__ = ["PROBE", "TurnRenderer", "TokenizeFailed", "OPEN_CACHE_ENTRIES"]

OPEN_CACHE_ENTRIES = 1024
"""Open renderings kept (model x template arguments), least recently used first out."""

PROBE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "kvkeep probe question"},
    {"role": "assistant", "content": "kvkeep probe answer"},
)
"""The stand-in conversation the new turn is rendered after (its content is never sent on)."""

# Request fields that shape the chat template's rendering, passed to /tokenize as they are.
_TEMPLATE_FIELDS = ("chat_template_kwargs", "tools", "documents")
_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


class TokenizeFailed(Exception):
    """The worker could not be asked (unreachable, 5xx): try another."""


class TurnRenderer:
    """Asks workers' `/tokenize`; caches the probe's open rendering per model."""

    def __init__(self, http: aiohttp.ClientSession, *,
                 max_open: int = OPEN_CACHE_ENTRIES) -> None:
        self._http = http
        self._max_open = max_open
        self._open: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    async def chat_suffix(self, url: str, model: str, body: dict[str, Any]) -> list[int]:
        """The tokens of the new turn (`body["messages"]`), as the template renders them
        after an assistant answer's content, up to and including the generation prompt."""
        extra = {k: body[k] for k in _TEMPLATE_FIELDS if body.get(k) is not None}
        cache_key = hashlib.sha256(json.dumps([model, extra], sort_keys=True, default=str)
                                   .encode("utf-8", "surrogatepass")).digest()
        opened = self._open.get(cache_key)
        if opened is None:
            opened = tuple(await self._tokenize(url, {
                "model": model, "messages": list(PROBE), "add_generation_prompt": False,
                "continue_final_message": True, **extra}))
            self._open[cache_key] = opened
            while len(self._open) > self._max_open:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(cache_key)
        continues = bool(body.get("continue_final_message"))
        full = await self._tokenize(url, {
            "model": model, "messages": [*PROBE, *body["messages"]],
            "add_generation_prompt": bool(body.get("add_generation_prompt", True))
            and not continues, "continue_final_message": continues, **extra})
        if len(full) <= len(opened) or tuple(full[:len(opened)]) != opened:
            raise ContinuationUnsupported(
                f"the chat template of `{model}` does not render a new turn as a "
                "continuation of the previous ones; send the whole history")
        return full[len(opened):]

    async def text_tokens(self, url: str, model: str, text: str) -> list[int]:
        return await self._tokenize(url, {"model": model, "prompt": text,
                                          "add_special_tokens": False})

    async def _tokenize(self, url: str, body: dict[str, Any]) -> list[int]:
        try:
            async with self._http.post(url + "/tokenize", json=body, timeout=_TIMEOUT,
                                       allow_redirects=False) as resp:
                data = await read_capped(resp, TOKENIZE_MAX_BYTES, f"{url}/tokenize answer")
                status = resp.status
        except UpstreamTooLarge as exc:
            raise TokenizeFailed(str(exc)) from exc
        except UPSTREAM_ERRORS as exc:
            raise TokenizeFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
        if status >= 500:
            raise TokenizeFailed(f"{url}: /tokenize answered {status}")
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if status != 200 or not isinstance(obj, dict) or not _ids(obj.get("tokens")):
            message = _message(obj) or f"/tokenize answered {status}"
            if status in (404, 405):  # a worker without /tokenize (not vLLM)
                raise ContinuationUnsupported(f"the workers cannot render a new turn: {message}")
            if 400 <= status < 500:  # the new turn itself is wrong (bad messages, too long)
                raise BadRequest(f"the new turn cannot be rendered: {message}")
            raise ContinuationUnsupported(f"the new turn cannot be rendered: {message}")
        return list(obj["tokens"])


def _ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def _message(obj: object) -> str | None:
    if isinstance(obj, dict):
        error = obj.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:300]
        if isinstance(obj.get("message"), str):
            return str(obj["message"])[:300]
    return None


def token_ids(value: object) -> Sequence[int] | None:
    """A token-id list, or None."""
    return value if isinstance(value, list) and _ids(value) else None
