"""Discord-side tests: real discord.py objects from gateway payloads, real interactions."""
