"""The SQLite engine of the storage contract: one database file with sqlite-vec and FTS5."""
