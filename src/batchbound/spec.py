"""Spec strings: ``name`` or ``name(key=value, ...)``.

Used for model specs (``fc(depth=4,params=16000,act=relu)``,
``resnet(blocks=[2,2,2,2],params=2e6)``), data sets (``synthetic-linear(n=2000,d=50)``) and
schedules (``lsr(base_batch=32,warmup_epochs=5)``). Values are ints, floats (``2e6`` is an
int when integral), booleans ``true``/``false``, bare words, quoted strings and lists.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batchbound.errors import BatchboundError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


@dataclass(frozen=True)
class Spec:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.kwargs:
            return self.name
        args = ",".join(f"{k}={_format(v)}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format(v) for v in value) + "]"
    return str(value)


def parse_spec(text: str) -> Spec:
    """Parse ``name(key=value, ...)``; raise BatchboundError pointing at the bad character."""
    return _Parser(text).spec()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str) -> BatchboundError:
        # one line, as every refusal: the place named by what follows it, not a caret below
        rest = self.text[self.pos:]
        where = f"before {rest!r}" if rest.strip() else "at its end"
        return BatchboundError(
            f"malformed spec {self.text!r}: {what} at position {self.pos} ({where}); "
            "expected name or name(key=value, ...), e.g. fc(depth=4,params=16000,act=relu)"
        )

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            found = repr(self.peek()) if self.peek() else "end of text"
            raise self.fail(f"expected {char!r}, found {found}")
        self.pos += 1

    def name(self) -> str:
        self.skip()
        match = _NAME.match(self.text, self.pos)
        if not match:
            raise self.fail("expected a name")
        self.pos = match.end()
        return match.group()

    def spec(self) -> Spec:
        name = self.name()
        kwargs: dict[str, Any] = {}
        if self.peek() == "(":
            self.pos += 1
            while self.peek() != ")":
                key = self.name()
                if key in kwargs:
                    raise self.fail(f"duplicate key {key!r}")
                self.expect("=")
                kwargs[key] = self.value()
                if self.peek() == ",":
                    self.pos += 1
                elif self.peek() != ")":
                    raise self.fail("expected ',' or ')'")
            self.pos += 1
        if self.peek():
            raise self.fail("unexpected trailing text")
        return Spec(name, kwargs)

    def value(self) -> Any:
        char = self.peek()
        if not char:
            raise self.fail("expected a value, found end of text")
        if char == "[":
            self.pos += 1
            items = []
            while self.peek() != "]":
                items.append(self.value())
                if self.peek() == ",":
                    self.pos += 1
                elif self.peek() != "]":
                    raise self.fail("expected ',' or ']'")
            self.pos += 1
            return items
        if char in "\"'":
            end = self.text.find(char, self.pos + 1)
            if end < 0:
                raise self.fail("unterminated string")
            value = self.text[self.pos + 1 : end]
            self.pos = end + 1
            return value
        match = re.compile(r"[^,()\[\]\s]+").match(self.text, self.pos)
        if not match:
            raise self.fail("expected a value")
        self.pos = match.end()
        return _scalar(match.group())


def _scalar(token: str) -> Any:
    lowered = token.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(token)
    except ValueError:
        pass
    try:
        number = float(token)
    except ValueError:
        return token
    return int(number) if number.is_integer() and "e" in lowered and "." not in token else number


def did_you_mean(words: Iterable[str], choices: Iterable[str]) -> str:
    """`` (did you mean 'width'?)`` for the misspelt words close to one choice, else ''."""
    choices = list(choices)
    close = [match[0] for word in words
             if (match := difflib.get_close_matches(word, choices, n=1, cutoff=0.75))]
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def check_options(what: str, given: Iterable[str], options: Iterable[str]) -> None:
    """Refuse options a spec does not take, naming them and the ones it does:
    ``model 'fc' has no option 'widht' (did you mean 'width'?); options: depth, width``."""
    options = list(options)
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise BatchboundError(f"{what} has no option {', '.join(map(repr, unknown))}"
                              f"{did_you_mean(unknown, options)}; "
                              f"options: {', '.join(options) or '(none)'}")
