"""Where the bot's memory is kept: the storage contract and its engines.

:mod:`memory.storage.contract` says what the rest of the bot may ask of a database
(one Protocol per noun: messages, forgetting, guilds, the embedding backlog, meta,
the keyword index, the vector index); :mod:`memory.storage.sqlite` implements it on
one SQLite file.  Nothing above this package writes SQL.
"""
