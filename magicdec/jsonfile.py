"""Reading JSON files that users hand us (configs, profiles, tables, results), with errors that name the file.

No torch here: the planner uses it too.
"""

from __future__ import annotations

import json
import os
from typing import Any

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


def read_json_object(path: str | os.PathLike[str], what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in `path`; raises `error` naming the file and `what` it should hold when the file is not
    UTF-8, not JSON, or holds something other than an object (a list, null, ...)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a valid {what} (not UTF-8 text: byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not a valid {what} (invalid JSON at line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a valid {what} (expected a JSON object, found {_JSON_KINDS[type(data)]})")
    return data
