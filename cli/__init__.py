"""The command line, demo and benchmarks: tooling that drives the memory engine from outside.

``cli.app.main`` is the entry point (``bot.py`` and the ``discord-memory-bot`` script).
"""
