"""The tiny local Llama the tests run real vLLM engines on.

It is the same builder the demo and chaos runs use (`deploy/local/model.py`): one model, one
place. Built from a fixed seed with no downloads; see that module for why it looks as it does.
"""

from __future__ import annotations

from deploy.local.model import CHAT_TEMPLATE, TinyModel, build_tiny_llama

__all__ = ["CHAT_TEMPLATE", "TinyModel", "build_tiny_llama"]
