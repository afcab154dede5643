"""Where a message's author gets their name: the ``member_names`` row of the message's
guild, never another guild's.

A nickname is a fact about one server (a member is "Priya" in one and "p.raman" in
another), so names are stored per ``(guild_id, author_id)`` and every read of a
message's author joins on both.  ``authors`` keeps only what is one fact about the
account everywhere (its id, whether it is a bot).  The fragments below are plain SQL
both engines run as written.
"""

from __future__ import annotations

AUTHOR_JOIN = "LEFT JOIN member_names a ON a.guild_id = m.guild_id AND a.author_id = m.author_id"
"""Joins a message ``m`` to its author's names in ``m``'s guild (``a``; absent: no row)."""

AUTHOR_NAME = "COALESCE(NULLIF(a.display_name, ''), a.name, '')"
"""A message's author as a reader sees them: the display name, else the user name."""

AUTHOR_NAMES = "COALESCE(a.name, ''), COALESCE(a.display_name, '')"
"""Both names (``name``, ``display_name``), ``''`` where unknown."""
