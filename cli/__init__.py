"""The command line and the demo: tooling that drives the memory engine from outside.

``cli.app.main`` is the entry point (``bot.py`` and the ``discord-memory-bot`` script):
``app`` (the offline commands), ``run`` (the Discord bot), ``migrate`` (``migrate-db``),
``demo``, ``scoring`` (labelled questions), ``context``/``params``/``output`` (settings,
option types, what is printed).  The benchmarks live beside it in ``benchmarks/``
(a source checkout only).
"""
