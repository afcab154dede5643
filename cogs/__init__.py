"""Discord glue: the memory extension is :mod:`cogs.memory` (its docstring maps it)."""
