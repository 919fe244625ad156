"""Strings from outside (a client's model name or end user, an upstream's response model, an imported
record's fields) as every sink may keep them: records (PostgreSQL text refuses NUL; a lone UTF-16
surrogate, valid in JSON as `\\ud800`, is no UTF-8 at all), spans, metric labels, logs.
"""
from __future__ import annotations

import json
import re
from typing import Any

import orjson

ERROR_CODE_CHARS = 64  # an error code an upstream's stream named (`stream_error:CODE`)
MODEL_CHARS = 256  # a model name as measured (the request is sent on unchanged: the rest is the client's business)
_UNSTORABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # controls (NUL among them) and lone surrogates


def storable(value: str, limit: int = MODEL_CHARS) -> str:
    """At most `limit` characters, controls and lone surrogates replaced by U+FFFD."""
    value = value[:limit]
    return _UNSTORABLE.sub("\ufffd", value) if _UNSTORABLE.search(value) else value


def dumps(value: Any) -> bytes:
    """JSON of a value parsed from outside: orjson's, or, where orjson refuses what Python's parser accepted (a lone
    surrogate, an integer past 64 bits: chunk.lenient), Python's, the surrogate's bytes passed through as they are."""
    try:
        return orjson.dumps(value)
    except TypeError:  # (orjson.JSONEncodeError)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def json_text(value: Any) -> str:
    """A value's JSON as text, to count as a prompt's part (`dumps`: whatever a lenient parse made of it)."""
    return dumps(value).decode("utf-8", "replace")
