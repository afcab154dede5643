"""What both engines' backlogs share: when a vector made from a pending message is
still a true fact about the stored texts.

A message's vector is made from its author's name, its text and attachments, and
for a short chat line its antecedent's author and text
(:meth:`memory.engine.MemoryEngine.embedding_text`).  Any of them may change while
the vector is being made: the message or its antecedent edited, deleted, or
forgotten with its member, or a reply's target stored late.  A vector is a fact
about every text it was made from (house style 29), so it is written only when all
of them are still what the embedder read; otherwise the message stays in the
backlog and is embedded again from the current texts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from memory.records import PendingMessage

log = logging.getLogger(__name__)


def made_from(message: PendingMessage) -> tuple[object, ...]:
    """Everything a pending message's vector may be made from (its antecedent included,
    whether or not the profile embeds it: a changed antecedent costs at most one
    needless re-embedding)."""
    return (message.author_name, message.content, message.attachments,
            message.antecedent_id, message.antecedent_author, message.antecedent_content)


def still_current(read: Sequence[PendingMessage], now: Iterable[PendingMessage]) -> set[int]:
    """Ids of the messages in ``read`` whose every source text is unchanged in ``now``.

    Args:
        read: The messages as the embedder read them.
        now: The same messages read again inside the transaction that writes their
            vectors (a deleted one is missing).

    Returns:
        The ids whose vectors may be written; the rest stay in the backlog.
    """
    current = {m.id: made_from(m) for m in now}
    kept = {m.id for m in read if current.get(m.id) == made_from(m)}
    if len(kept) < len(read):
        log.info("%d of %d messages changed (or their antecedent did) while they were "
                 "embedded: they stay in the backlog", len(read) - len(kept), len(read))
    return kept


def pending_message(
    fields: dict[str, Any], antecedent: tuple[int, str, str] | None
) -> PendingMessage:
    """A pending message from its stored fields and its antecedent's ``(id, author, text)``."""
    if antecedent is None:
        return PendingMessage(**fields)
    return PendingMessage(**fields, antecedent_id=antecedent[0],
                          antecedent_author=antecedent[1], antecedent_content=antecedent[2])
