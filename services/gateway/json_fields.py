"""Reading the fields of a decoded JSON request body: each wrong one is an
InvalidParameterError in OpenAI's words, naming the field (its ``param``), what was
expected and what came. The OpenAI request parsers (`openai_protocol.py`) read every
field through these.
"""

from collections.abc import Collection
from typing import Any

from services.gateway.errors import InvalidParameterError
from services.gateway.request_limits import IGNORED_FIELDS, RANGES, UNSUPPORTED_UNLESS


def fields_of(body: Any, fields: frozenset[str]) -> dict[str, Any]:
    """The body as an object, once no field in it asks for what kvserve would ignore."""
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    for name, allowed in UNSUPPORTED_UNLESS.items():
        value = body.get(name)
        if value is not None and not any(same(value, a) for a in allowed):
            raise InvalidParameterError(f"'{name}' is not supported by this server", name)
    for name, kind in IGNORED_FIELDS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise type_error(name, JSON_TYPES[kind], value)
    refuse_unknown(body, fields | UNSUPPORTED_UNLESS.keys() | IGNORED_FIELDS.keys())
    return body


def refuse_unknown(body: dict[str, Any], known: Collection[str], prefix: str = "") -> None:
    for name in body:
        if name not in known:
            shown = show(name)
            raise InvalidParameterError(f"Unrecognized request argument supplied: {prefix}{shown}", prefix + shown)


def required(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise InvalidParameterError(f"Missing required parameter: '{name}'.", name)
    return body[name]


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise type_error(name, "an integer", value)
    check_range(name, value, "an integer")
    return value


def float_field(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise type_error(name, "a number", value)
    check_range(name, value, "a number")
    return float(value)  # in range, so an int of any size converts


def bool_field(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise type_error(param or name, "a boolean", value)
    return value


def int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise type_error(name, "an array of integers", value)
    check_items(name, value)
    return value


def check_range(param: str, value: int | float, kind: str) -> None:
    valid = RANGES[param]
    if value not in valid:
        raise InvalidParameterError(f"Invalid '{param}': expected {kind} in {valid}, but got {show(value)}.", param)


def check_items(name: str, values: list[int]) -> None:
    valid = RANGES[name]
    for i, value in enumerate(values):
        if value not in valid:
            message = f"Invalid '{name}[{i}]': expected an integer in {valid}, but got {show(value)}."
            raise InvalidParameterError(message, f"{name}[{i}]")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def same(value: Any, allowed: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same number, but true is not 1."""
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def show(value: Any, limit: int = 40) -> str:
    """``value`` for an error message, cut short (a 4,000-digit integer must not echo back)."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:  # an integer past Python's 4,300-digit limit on str()
        return "a number too large to show"
    return text if len(text) <= limit else text[:limit] + "..."


JSON_TYPES = {
    str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array", dict: "an object"
}


def type_error(param: str, expected: str, value: Any) -> InvalidParameterError:
    got = "null" if value is None else JSON_TYPES.get(type(value), type(value).__name__)
    return InvalidParameterError(f"Invalid type for '{param}': expected {expected}, but got {got} instead.", param)
