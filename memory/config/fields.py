"""How a profile key is specified and checked: type, choices, range, bucket shapes.

Each section is a frozen dataclass whose fields carry their checks in ``metadata``
(:func:`choices`, :func:`bounds`, ``{"shapes": True}``, ``{"costs": True}``);
:func:`check_value` applies
them to one TOML value and names the file and the key when it is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from memory.errors import ConfigError


def choices(*values: str) -> dict[str, Any]:
    """A field's allowed values (``metadata=choices(...)``)."""
    return {"choices": values}


def bounds(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    """A field's inclusive range (``metadata=bounds(lo, hi)``); ``None`` is open."""
    return {"min": lo, "max": hi}


MAX_BUCKETS = 16
_BUCKET_BATCH, _BUCKET_LENGTH = (1, 1024), (1, 32768)


def check_shapes(source: str, key: str, value: Any) -> tuple[tuple[int, int], ...]:
    """Validate a list of ``[batch, length]`` pairs and return it as sorted tuples."""
    example = "e.g. [[32, 64], [32, 128], [8, 512]]"
    if not isinstance(value, list) or len(value) > MAX_BUCKETS:
        raise ConfigError(
            f"{source}: {key} must be a list of at most {MAX_BUCKETS} [batch, length] "
            f"pairs ({example}), got {value!r}"
        )
    shapes = []
    for pair in value:
        ok = (
            isinstance(pair, list) and len(pair) == 2
            and all(type(n) is int for n in pair)
            and _BUCKET_BATCH[0] <= pair[0] <= _BUCKET_BATCH[1]
            and _BUCKET_LENGTH[0] <= pair[1] <= _BUCKET_LENGTH[1]
        )
        if not ok:
            raise ConfigError(
                f"{source}: {key} entries must be [batch, length] with batch in "
                f"{list(_BUCKET_BATCH)} and length in {list(_BUCKET_LENGTH)} ({example}), "
                f"got {pair!r}"
            )
        shapes.append((pair[0], pair[1]))
    if len(set(shapes)) != len(shapes):
        raise ConfigError(f"{source}: {key} lists the same shape twice: {value!r}")
    return tuple(sorted(shapes, key=lambda s: (s[1], s[0])))


def check_costs(source: str, key: str, value: Any) -> tuple[tuple[int, int, float], ...]:
    """Validate a list of ``[batch, length, milliseconds]`` step times; return it as tuples.

    The shapes are checked as :func:`check_shapes` checks buckets; each time must be a
    positive, finite number of milliseconds.
    """
    example = "e.g. [[32, 64, 1.8], [8, 512, 4.1]], as `bench step-costs` writes them"
    if not isinstance(value, list) or not all(
        isinstance(entry, list) and len(entry) == 3 for entry in value
    ):
        raise ConfigError(
            f"{source}: {key} must be a list of [batch, length, milliseconds] ({example}), "
            f"got {value!r}"
        )
    shapes = check_shapes(source, key, [entry[:2] for entry in value])
    times: dict[tuple[int, int], float] = {}
    for batch, length, ms in value:
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 < ms < math.inf:
            raise ConfigError(
                f"{source}: {key} times must be positive milliseconds ({example}), "
                f"got {ms!r} for [{batch}, {length}]"
            )
        times[(batch, length)] = float(ms)
    return tuple((batch, length, times[(batch, length)]) for batch, length in shapes)


def check_value(source: str, key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    """Check one TOML value against its field; return it as the field's type.

    Raises:
        ConfigError: Wrong type, not one of the choices, or out of range; the message
            names ``source`` and ``key``.
    """
    if f.metadata.get("shapes"):
        return check_shapes(source, key, value)
    if f.metadata.get("costs"):
        return check_costs(source, key, value)
    expected = type(f.default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"{source}: {key} must be {expected.__name__}, got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{source}: {key} must be a number, got nan")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{source}: {key} must be one of {', '.join(choices)}, got {value!r}")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{source}: {key} must be within [{lo}, {hi}], got {value!r}")
    return value
