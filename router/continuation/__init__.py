"""Stateful continuation: a session's conversation kept in the kvkeep store, so a client may
send only its new turn (`service.py`), rendered by the worker's own chat template
(`render.py`), and recorded at the end of every turn (`records.py`)."""

from router.continuation.config import ContinuationConfig
from router.continuation.records import ConversationRecords, MemoryRecords, StoreRecords
from router.continuation.service import (
    CONTINUE_FIELD,
    CONTINUE_HEADER,
    HISTORY_HEADER,
    Continuations,
    TurnEnd,
    asks_continuation,
)

__all__ = ["CONTINUE_FIELD", "CONTINUE_HEADER", "HISTORY_HEADER", "ContinuationConfig",
           "Continuations", "ConversationRecords", "MemoryRecords", "StoreRecords", "TurnEnd",
           "asks_continuation"]
