"""Parsing and validating OpenAI completion, chat and Responses API requests, and the facts
routing needs.

Validation is only what the router itself relies on (JSON object, model, prompt or messages or
input, stream, n, max_tokens, session id); everything else is the worker's to judge, and its
400s pass through unchanged. Router-only fields (`session_id`) are removed before forwarding
(vLLM's Responses API has a `session_id` of its own, an identity it only carries: the router's
session is the same idea, so the field names the router's session there too).

A Responses API request (`POST /v1/responses`) is routed like the others (its prompt text,
for prefix routing, is its `instructions` then its `input`, rendered as chat messages are; its
limit `max_output_tokens`) but never resumed: `resumable` is always False (see
`router/streaming/responses_api.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvstore.errors import InvalidKey
from kvstore.keys import SessionId, validate_session_id
from router.decision import RequestFeatures
from router.errors import BadRequest, InvalidSessionId
from router.tenants import DEFAULT_TENANT

__all__ = ["Endpoint", "ClientRequest", "parse_request", "max_new_tokens", "SESSION_HEADER",
           "SESSION_FIELD", "COMPLETIONS_DEFAULT_MAX_TOKENS"]

SESSION_HEADER = "X-Session-Id"
SESSION_FIELD = "session_id"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's `max_tokens` for a completions request that gives none (or null)."""
# Fields that make a resumed continuation differ from the original stream, or that the
# completions endpoint a resumption uses cannot carry. (Structured output would restart its
# grammar at the resent tokens; tools need the chat template's parsing of the whole answer.)
_NOT_RESUMABLE = ("tools", "functions", "response_format", "structured_outputs", "guided_json",
                  "guided_regex", "guided_choice", "guided_grammar", "suffix", "prompt_logprobs",
                  "echo")


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A parsed client request. `body` is what goes to the worker (router fields removed)."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    session_id: SessionId | None
    wants_token_ids: bool
    include_usage: bool
    prompt_text: str
    prompt_tokens: tuple[int, ...] | None
    max_tokens: int | None
    """New tokens each choice may have, as the worker reads the request (`max_new_tokens`)."""
    resumable: bool
    logprobs: int | None = None
    """Top log-probabilities asked per token (0: the sampled token's only); None: none asked.
    A resumed stream asks its continuation for the same and rewrites them into this format."""
    tenant: str = DEFAULT_TENANT
    cache_salt: str | None = None
    """The vLLM cache salt the request goes with (the tenant's, with API keys)."""
    strip_stops: bool = False
    """The router asked workers to keep stop strings in the text and drops them itself
    (`router/front/admission.py`)."""
    n: int = 1
    """Choices asked per prompt (each bounded by `max_tokens` on its own)."""

    @property
    def features(self) -> RequestFeatures:
        """What routing needs of this request."""
        # Load counts every choice's tokens: n choices cost the worker n times the decode.
        new = None if self.max_tokens is None else self.max_tokens * self.n
        return RequestFeatures(self.model, self.session_id, self.prompt_tokens, self.prompt_text,
                               new, tenant=self.tenant, cache_salt=self.cache_salt)

    @property
    def estimated_tokens(self) -> int:
        """Prompt + new tokens, for load accounting (4 characters a token when untokenized)."""
        return self.features.estimated_tokens


def parse_request(endpoint: Endpoint, raw: bytes, header_session: str | None) -> ClientRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` must be a non-empty string", param="model")

    session_id = _session_id(body.pop(SESSION_FIELD, None), header_session)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean", param="stream")
    max_tokens = max_new_tokens(endpoint, body)
    if endpoint is Endpoint.RESPONSES:
        # One answer per request (the Responses API has no `n`; vLLM ignores one), never
        # resumed: its typed events carry sequence numbers and item ids that a continuation
        # on another worker cannot reproduce.
        return ClientRequest(endpoint, body, model, stream, session_id, False, False,
                             _responses_prompt(body.get("input"), body.get("instructions")),
                             None, max_tokens, False)

    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest("`n` must be a positive integer", param="n")

    if endpoint is Endpoint.CHAT:
        prompt_text, prompt_tokens = _chat_prompt(body.get("messages")), None
        single_prompt = True
    else:
        prompt_text, prompt_tokens, single_prompt = _completion_prompt(body.get("prompt"))

    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    wants_ids = bool(body.get("return_token_ids"))
    logprobs, logprobs_ok = _logprobs(endpoint, body)
    # n > 1 resumes too: each unfinished choice continues from its own prefix, all in one
    # continuation (a batch of prompts: `streaming/state.StreamState.continuation_prompt`).
    resumable = (stream and single_prompt and not body.get("best_of")
                 and logprobs_ok and not any(body.get(k) for k in _NOT_RESUMABLE)
                 and _penalties_carry(body))
    return ClientRequest(endpoint, body, model, stream, session_id, wants_ids, include_usage,
                         prompt_text, prompt_tokens, max_tokens, resumable, logprobs, n=n)


def max_new_tokens(endpoint: Endpoint, body: dict[str, Any]) -> int | None:
    """The most tokens the worker may generate for each choice, read as vLLM 0.32 reads the
    request (None: as many as the model's context leaves).

    Chat takes `max_completion_tokens` over `max_tokens` (vLLM's chat serving code; OpenAI
    deprecated `max_tokens` for chat); completions know only `max_tokens`, and vLLM gives a
    missing or null one its default of 16. The Responses API knows only `max_output_tokens`
    (`ResponsesRequest.to_sampling_params`: the smaller of it and what the context leaves;
    missing or null, what the context leaves). The bound is per choice: `n` choices (and each
    prompt of a batch) may each generate this many. `min_tokens`, `ignore_eos` and
    `stop_token_ids` never raise it (vLLM refuses `min_tokens` over it; a stop token counts
    within it). Reading this differently from the worker would make an honest worker look
    as if it overran the stream (trust review H1).
    """
    fields = {Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
              Endpoint.RESPONSES: ("max_output_tokens",)}.get(endpoint, ("max_tokens",))
    found: int | None = None
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"`{name}` must be a non-negative integer", param=name)
        if found is None:
            found = value
    if found is None and endpoint is Endpoint.COMPLETIONS:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return found


def _penalties_carry(body: dict[str, Any]) -> bool:
    """Whether a continuation can penalize the tokens already sent as the unbroken stream
    would have (they are its prompt there, and vLLM's presence and frequency penalties count
    output tokens only).

    `repetition_penalty` counts prompt and output alike: carried as it is. A frequency
    penalty is carried exactly as a `logit_bias` of minus penalty x count per token sent
    (`streaming/resume.resume_body`): vLLM adds both to the logits before sampling, in
    an order that matters only against a repetition penalty other than 1, so that pair is not
    resumed. A presence penalty cannot be (a token already sent must be penalized once,
    whether or not it comes again: no fixed bias says that), so it is not resumed either: a
    break ends such a stream with an error event rather than a continuation that samples
    differently from an unbroken one."""
    def given(name: str) -> bool:
        return body.get(name) not in (None, 0, 0.0)

    if given("presence_penalty"):
        return False
    if given("frequency_penalty"):
        value = body["frequency_penalty"]
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if body.get("repetition_penalty") not in (None, 1, 1.0):
            return False
        bias = body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            return False
    return True


def _logprobs(endpoint: Endpoint, body: dict[str, Any]) -> tuple[int | None, bool]:
    """(top log-probabilities asked per token or None, whether a resumption can give them).
    Chat asks `logprobs: true` with `top_logprobs: k`; completions ask `logprobs: k`. Values
    of the wrong type are the worker's to refuse, and are never resumed."""
    asked = body.get("logprobs")
    if endpoint is Endpoint.CHAT:
        top = body.get("top_logprobs")
        if asked is None or asked is False:
            return None, top is None or top == 0
        if asked is not True:
            return None, False
        if top is None:
            return 0, True
        if isinstance(top, int) and not isinstance(top, bool) and top >= 0:
            return top, True
        return None, False
    if asked is None:
        return None, True
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        return asked, True
    return None, False


def _session_id(from_body: object, from_header: str | None) -> SessionId | None:
    if from_body is not None and not isinstance(from_body, str):
        raise InvalidSessionId("`session_id` must be a string", param=SESSION_FIELD)
    if from_body is not None and from_header is not None and from_body != from_header:
        raise InvalidSessionId(f"`session_id` and the {SESSION_HEADER} header disagree",
                               param=SESSION_FIELD)
    value = from_header if from_header is not None else from_body
    if value is None:
        return None
    try:
        return validate_session_id(value)
    except InvalidKey as exc:
        raise InvalidSessionId(str(exc), param=SESSION_FIELD) from exc


def _chat_prompt(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty array", param="messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts shape the prefix
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', '')}:{content if content is not None else ''}\n")
    return "".join(parts)


def _responses_prompt(items: object, instructions: object) -> str:
    """The text of a Responses API prompt, for prefix routing: `instructions` (vLLM makes it
    the system message) then `input`, a string (one user message) or a list of items (messages
    whose content is a string or content parts, and items such as function-call outputs, whose
    text is their `output`), rendered as `_chat_prompt` renders messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("`instructions` must be a string", param="instructions")
    head = f"system:{instructions}\n" if instructions else ""
    if isinstance(items, str):
        return f"{head}user:{items}\n"
    if not isinstance(items, list):
        raise BadRequest("`input` must be a string or an array of input items", param="input")
    parts = [head]
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("each input item must be an object", param="input")
        content = item.get("content", item.get("output"))
        if isinstance(content, list):  # content parts: only text parts shape the prefix
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        role = item.get("role", item.get("type", ""))
        parts.append(f"{role}:{content if content is not None else ''}\n")
    return "".join(parts)


def _completion_prompt(prompt: object) -> tuple[str, tuple[int, ...] | None, bool]:
    """(text for approximate keys, token ids if given, whether it is a single prompt)."""
    if isinstance(prompt, str):
        return prompt, None, True
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = tuple(prompt)
            return " ".join(map(str, tokens)), tokens, True
        if all(isinstance(p, str) for p in prompt):
            return str(prompt[0]), None, len(prompt) == 1
        if all(isinstance(p, list) for p in prompt):
            return "", None, False
    raise BadRequest("`prompt` must be a string, an array of strings or of token ids",
                     param="prompt")
