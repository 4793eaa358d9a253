"""The tokenizer and value grammar of `[GRPO Debug]` text: `key: value, key=value ...` into
(normalised key, Python value) pairs, values being the reprs Python, numpy and torch print.

A tokenizer and a recursive-descent reader read numbers, strings, lists with or without commas, tuples, dicts,
sets, constructor calls (tensor, array, Counter, defaultdict, torch.Size, np.int64 ...) and `<...>` type reprs;
where a value cannot be read, the reader says why instead of guessing.
"""

from __future__ import annotations

import re
from typing import Any


class _Tok:
    __slots__ = ("kind", "text", "val")

    def __init__(self, kind: str, text: str, val: Any = None):
        self.kind, self.text, self.val = kind, text, val

    def __repr__(self) -> str:
        return f"{self.kind}:{self.text}"


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
  | (?P<ellipsis>\.\.\.|…)
  | (?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)|[-+]?(?i:nan|inf)(?![A-Za-z0-9_]))
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<punct>[\[\](){}:,;=<>])
  | (?P<other>.)
""", re.X | re.S)


def _tokenize(text: str) -> list[_Tok]:
    out = []
    for m in _TOKEN.finditer(text):
        kind, s = m.lastgroup, m.group()
        if kind == "ws":
            continue
        if kind == "num":
            low = s.lower()
            val = float(low) if any(c in low for c in ".en") else int(s)  # "e" and "n": exponents, nan, inf
            out.append(_Tok("num", s, val))
        elif kind == "str":
            out.append(_Tok("str", s, s[1:-1]))
        else:
            out.append(_Tok(kind, s))
    return out


def _depth(tokens: list[_Tok]) -> int:
    d = 0
    for t in tokens:
        if t.kind == "punct":
            d += (t.text in "[({") - (t.text in "])}")
    return d


def _open(tokens: list[_Tok]) -> bool:
    """Whether a value continues on the next line: brackets still open, or a key waiting for its value."""
    return _depth(tokens) > 0 or (len(tokens) > 1 and tokens[-1].kind == "punct" and tokens[-1].text in ":="
                                  and tokens[-2].kind == "word")  # `=== Epoch 4 ===` is decoration, not a key


class _Elided:
    """An array or dict printed with `...`: its length and contents are unknown."""


class _Opaque:
    """A value read but not interpretable (`<class 'int'>`, a set, an unknown constructor)."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


class _Stop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_CONTAINERS = {"tensor", "array", "asarray", "as_tensor", "from_numpy", "list", "tuple"}
_MAPPINGS = {"counter", "ordereddict", "dict", "defaultdict"}
_SCALARS = {"int", "float", "long", "double", "half", "bool_", "bfloat16", "int8", "int16", "int32", "int64",
            "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64", "intc", "longlong"}
_CONSTANTS = {"true": True, "false": False, "none": None}


class _Reader:
    """Recursive descent over tokens: numbers, strings, lists with or without commas, tuples, dicts, sets,
    constructor calls (tensor, array, Counter, defaultdict, torch.Size, np.int64 ...), `<...>` type reprs."""

    def __init__(self, tokens: list[_Tok]):
        self.toks, self.i = tokens, 0

    def peek(self, k: int = 0) -> _Tok | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def at(self, text: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t.kind in ("punct", "other") and t.text == text

    def take(self) -> _Tok:
        t = self.peek()
        if t is None:
            raise _Stop("ends before the value does (truncated line?)")
        self.i += 1
        return t

    def expect(self, text: str) -> None:
        t = self.take()
        if not (t.kind in ("punct", "other") and t.text == text):
            raise _Stop(f"expected {text!r}, found {t.text!r}")

    def starts_value(self) -> bool:
        t = self.peek()
        if t is None:
            return False
        return (t.kind in ("num", "str", "ellipsis") or (t.kind == "punct" and t.text in "[({<")
                or (t.kind == "word" and self.at("(", 1)))

    def value(self) -> Any:
        t = self.take()
        if t.kind in ("num", "str"):
            return t.val
        if t.kind == "ellipsis":
            return _Elided()
        if t.kind == "punct":
            if t.text == "[":
                return self.sequence("]")
            if t.text == "(":
                return self.parens()
            if t.text == "{":
                return self.braces()
            if t.text == "<":
                return self.angle()
        if t.kind == "word":
            if self.at("("):
                self.take()
                return self.call(t.text)
            return _CONSTANTS.get(t.text.lower(), t.text)
        raise _Stop(f"unexpected {t.text!r}")

    def sequence(self, close: str) -> list | _Elided:
        items, elided = [], False
        while not self.at(close):
            v = self.value()
            elided |= isinstance(v, _Elided)
            items.append(v)
            if self.at(","):
                self.take()
        self.take()
        return _Elided() if elided else items

    def parens(self) -> Any:
        if self.at(")"):
            self.take()
            return ()
        first = self.value()
        if self.at(")"):
            self.take()
            return first
        items = [first]
        while self.at(","):
            self.take()
            if self.at(")"):
                break
            items.append(self.value())
        self.expect(")")
        return _Elided() if any(isinstance(v, _Elided) for v in items) else tuple(items)

    def braces(self) -> Any:
        if self.at("}"):
            self.take()
            return {}
        first = self.value()
        if not self.at(":"):
            rest = self.sequence("}")
            return _Opaque("set") if not isinstance(rest, _Elided) else rest
        out: dict = {}
        key, elided = first, False
        while True:
            self.expect(":")
            val = self.value()
            if isinstance(key, _Elided) or isinstance(val, _Elided):
                elided = True
            else:
                try:
                    out[key] = val
                except TypeError:
                    raise _Stop(f"dict key {key!r} is not hashable") from None
            if self.at(","):
                self.take()
            if self.at("}"):
                self.take()
                return _Elided() if elided else out
            key = self.value()
            if isinstance(key, _Elided) and (self.at(",") or self.at("}")):  # `{1: 4, ...}`
                elided = True
                if self.at(","):
                    self.take()
                if self.at("}"):
                    self.take()
                    return _Elided()
                key = self.value()

    def angle(self) -> _Opaque:
        depth, parts = 1, []
        while depth:
            t = self.take()
            depth += (t.text == "<") - (t.text == ">") if t.kind == "punct" else 0
            parts.append(t.text)
        return _Opaque("<" + " ".join(parts))

    def call(self, name: str) -> Any:
        args, kwargs = [], {}
        while not self.at(")"):
            if self.peek() is not None and self.peek().kind == "word" and self.at("=", 1):
                key = self.take().text
                self.take()
                kwargs[key] = self.value()
            else:
                args.append(self.value())
            if self.at(","):
                self.take()
        self.take()
        if any(isinstance(a, _Elided) for a in args):
            return _Elided()
        base = name.rsplit(".", 1)[-1].lower()
        if base in _CONTAINERS and len(args) == 1:
            return args[0]
        if base == "size":
            return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else tuple(args)
        if base in _MAPPINGS:
            dicts = [a for a in args if isinstance(a, dict)]
            pairs = [a for a in args if isinstance(a, list) and all(isinstance(p, tuple) and len(p) == 2 for p in a)]
            if dicts:
                return dicts[-1]
            if pairs:  # OrderedDict([(3, 2), (5, 2)]) before Python 3.12
                try:
                    return dict(pairs[-1])
                except TypeError:
                    raise _Stop(f"unhashable key in {name}(...)") from None
            return dict(kwargs) if not args else _Opaque(name)
        if base in _SCALARS and len(args) == 1 and isinstance(args[0], (int, float)):
            return args[0]
        return _Opaque(name)


_ITEM_SEPS = {",", ";", ":", "|", "-", "=", "*", "#", "–", "—", ">", "."}  # ".": `rewards['avg'].shape`


def _norm_key(words: list[str]) -> str:
    return " ".join(" ".join(words).lower().replace("_", " ").replace(".", " ").split())


def _read_items(tokens: list[_Tok]) -> tuple[list[tuple[str, str, Any]], tuple[str, str] | None]:
    """(normalised key, key as printed, value) pairs of a record, and (key, reason) where reading stopped.

    An item is `words [: or =] value`; the separator may be left out when the value starts with something a
    name cannot (a number, a bracket, a quote, a constructor call), which is how `Condition 16416: ...` and
    `condition 16416 advantage mean: ...` both read as a `condition` item followed by stat items.
    """
    r = _Reader(tokens)
    items: list[tuple[str, str, Any]] = []
    while True:
        while r.peek() is not None and r.peek().kind in ("punct", "other") and r.peek().text in _ITEM_SEPS:
            r.take()
        if r.peek() is None:
            return items, None
        words = []
        while r.peek() is not None and r.peek().kind == "word" and not r.at("(", 1):
            words.append(r.take().text)
        if not words:
            return items, ("", f"expected a name, found {r.peek().text!r}")
        key, printed = _norm_key(words), " ".join(words)
        if r.at(":") or r.at("="):
            r.take()
            if r.peek() is None:
                return items, (printed, f"'{printed}' has no value (truncated line?)")
        elif not r.starts_value():
            return items, (printed, f"'{printed}' is not followed by a value")
        try:
            value = r.value()
        except _Stop as e:
            return items, (printed, f"'{printed}': {e.reason}")
        except RecursionError:
            return items, (printed, f"'{printed}': nested too deeply to read")
        if key == "epoch" and r.at("/") and r.peek(1) is not None and r.peek(1).kind == "num":
            r.take()
            r.take()  # "Epoch 3/10": the total is not a fact
        items.append((key, printed, value))
