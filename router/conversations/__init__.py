"""Stateful continuation: a session's conversation kept in the kvkeep store, so a client may
send only its new turn (`service.py`), rendered by the worker's own chat template
(`render.py`), and recorded at the end of every turn (`records.py`).

The package is named for what it keeps (conversations), not `continuation`: that word also
names the other feature, a broken stream resumed from its delivered tokens
(`router/streaming/resume.py`). The feature's settings keep their names (`--continuation`,
`RouterConfig.continuation`) so that existing deployments read the same."""

from router.conversations.config import ContinuationConfig
from router.conversations.records import ConversationRecords, MemoryRecords, StoreRecords
from router.conversations.service import (
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
