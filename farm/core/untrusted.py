"""Reading JSON the farm did not write itself: target dicts from users, export files.

`parse_json` is the one way such text is turned into Python values. It bounds what it accepts
(`MAX_JSON_BYTES` of text, `MAX_JSON_DEPTH` levels of nesting; farm documents are 5 deep) and
turns every way of failing into one FarmError line, so a truncated, malformed or hostile
document never reaches the code that reads it as a traceback (RecursionError from nesting,
MemoryError from size). Nothing parsed is ever executed or unpickled: JSON holds only data.
"""

from __future__ import annotations

import json
from typing import Any

from farm.core.errors import FarmError

# An export of a few thousand tasks is a few MB; 64 MiB leaves room and bounds the memory used.
MAX_JSON_BYTES = 64 * 2**20
# The deepest farm document (export -> records -> record -> workload -> params) is 5 levels.
MAX_JSON_DEPTH = 32


def parse_json(text: str | bytes, source: str) -> Any:
    """The value of the JSON `text`; FarmError naming `source` if it is not valid JSON (a
    truncated file), is larger than MAX_JSON_BYTES, or nests deeper than MAX_JSON_DEPTH."""
    if len(text) > MAX_JSON_BYTES:
        raise FarmError(f"{source} is {len(text):,} bytes, more than the {MAX_JSON_BYTES:,} the farm reads")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise FarmError(f"{source} is not valid JSON (truncated?): {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    except _NotJSON as e:
        raise FarmError(f"{source} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise FarmError(f"{source} is not valid JSON: it is not UTF-8 text") from None
    except RecursionError:
        raise FarmError(f"{source} nests deeper than the {MAX_JSON_DEPTH} levels the farm reads") from None
    check_depth(value, source)
    return value


def check_depth(value: Any, source: str, limit: int = MAX_JSON_DEPTH) -> None:
    """FarmError if `value` (dicts and lists) nests deeper than `limit`. Iterative, so a value
    nested deeper than Python's recursion limit is measured too."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            raise FarmError(f"{source} nests deeper than the {limit} levels the farm reads")
        stack.extend((child, depth + 1) for child in children)


class _NotJSON(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    # json accepts NaN and Infinity, which are not JSON; a latency of NaN would compare as
    # neither faster nor slower than anything.
    raise _NotJSON(f"{name} is not a JSON number")
