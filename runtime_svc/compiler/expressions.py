"""The Flow expression language: tokenizer, Pratt parser, AST and unparser.

Expressions are small, deterministic and side-effect free. They are parsed
into an immutable AST and evaluated by :func:`runtime_svc.compiler.evaluate.evaluate`;
nothing is ever handed to Python's ``eval``.

Grammar (lowest to highest precedence)::

    expr    := or
    or      := and ( ("||" | "or") and )*
    and     := not ( ("&&" | "and") not )*
    not     := ("!" | "not") not | cmp
    cmp     := sum ( ("==" | "=" | "!=" | "<>" | "<" | "<=" | ">" | ">=") sum )?
    sum     := term ( ("+" | "-") term )*
    term    := unary ( ("*" | "/" | "%") unary )*
    unary   := "-" unary | primary
    primary := NUMBER | STRING | true | false | null | "(" expr ")"
             | NAME "(" [expr ("," expr)*] ")"          -- function call
             | REF ("." NAME)*                           -- reference

``REF`` is a variable name or one of ``$Record``, ``$Record__Prior`` and
``$Event``. Keywords and function names are case-insensitive. Comparisons do
not chain (``a < b < c`` is a syntax error).

:func:`unparse` prints the canonical text of an AST (canonical operator
spellings, upper-case function names, minimal parentheses, normalized number
and string literals). Two sources that differ only in formatting have the same
canonical text, which is what the metadata digest hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import StrEnum

from services.invariants import InvariantError

__all__ = [
    "FUNCTIONS",
    "KEYWORDS",
    "Binary",
    "Call",
    "Expr",
    "ExpressionError",
    "Literal",
    "LiteralKind",
    "Ref",
    "Unary",
    "parse_expression",
    "references",
    "unparse",
]

#: Built-in functions: name → (minimum arity, maximum arity or ``None`` for variadic).
FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "ABS": (1, 1),
    "BEGINS": (2, 2),
    "CONCAT": (1, None),
    "CONTAINS": (2, 2),
    "ENDS": (2, 2),
    "IF": (3, 3),
    "ISBLANK": (1, 1),
    "LEN": (1, 1),
    "LOWER": (1, 1),
    "MAX": (1, None),
    "MIN": (1, None),
    "TEXT": (1, 1),
    "TRIM": (1, 1),
    "UPPER": (1, 1),
}


class ExpressionError(ValueError):
    """A malformed expression; ``position`` is the 0-based character offset."""

    def __init__(self, message: str, position: int, source: str) -> None:
        self.reason = message
        self.position = position
        self.source = source
        super().__init__(f"{message} at offset {position}")


class LiteralKind(StrEnum):
    """Literal value classes (kept explicit: ``True == 1`` in Python)."""

    NULL = "null"
    BOOLEAN = "boolean"
    NUMBER = "number"
    STRING = "string"


@dataclass(frozen=True)
class Literal:
    """A constant. Numbers are ``int`` or ``Decimal``, never ``float``."""

    kind: LiteralKind
    value: bool | int | Decimal | str | None


@dataclass(frozen=True)
class Ref:
    """A reference ``root.path[0].path[1]…``; ``pos`` is not part of equality."""

    root: str
    path: tuple[str, ...] = ()
    pos: int = field(default=0, compare=False)

    def dotted(self) -> str:
        """``root.a.b`` text."""
        return ".".join((self.root, *self.path))


@dataclass(frozen=True)
class Unary:
    """``!x`` or ``-x``."""

    op: str
    operand: Expr


@dataclass(frozen=True)
class Binary:
    """A binary operation with a canonical operator spelling."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Call:
    """A built-in function call; ``name`` is upper-case."""

    name: str
    args: tuple[Expr, ...]
    pos: int = field(default=0, compare=False)


Expr = Literal | Ref | Unary | Binary | Call

# ------------------------------------------------------------------ tokens


class _T(StrEnum):
    NUMBER = "number"
    STRING = "string"
    NAME = "name"
    OP = "operator"
    EOF = "end of input"


@dataclass(frozen=True)
class _Token:
    kind: _T
    text: str
    pos: int
    value: str | None = None  # decoded string literal


_OPS = (
    "==",
    "!=",
    "<>",
    "<=",
    ">=",
    "&&",
    "||",
    "=",
    "<",
    ">",
    "+",
    "-",
    "*",
    "/",
    "%",
    "!",
    "(",
    ")",
    ",",
    ".",
)
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"'}


def _is_name_start(c: str) -> bool:
    return c.isascii() and (c.isalpha() or c == "_")


def _is_name_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "_")


def _tokenize(src: str) -> list[_Token]:
    toks: list[_Token] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c in " \t\r\n":
            i += 1
            continue
        start = i
        if c.isascii() and c.isdigit():
            while i < n and src[i].isascii() and src[i].isdigit():
                i += 1
            if (
                i < n
                and src[i] == "."
                and i + 1 < n
                and src[i + 1].isascii()
                and src[i + 1].isdigit()
            ):
                i += 1
                while i < n and src[i].isascii() and src[i].isdigit():
                    i += 1
            if i < n and _is_name_char(src[i]):
                raise ExpressionError(f"malformed number {src[start : i + 1]!r}", start, src)
            toks.append(_Token(_T.NUMBER, src[start:i], start))
            continue
        if c in "'\"":
            i += 1
            buf: list[str] = []
            while True:
                if i >= n:
                    raise ExpressionError("unterminated string literal", start, src)
                ch = src[i]
                if ch == c:
                    i += 1
                    break
                if ch == "\\":
                    if i + 1 >= n or src[i + 1] not in _ESCAPES:
                        raise ExpressionError("invalid escape sequence in string literal", i, src)
                    buf.append(_ESCAPES[src[i + 1]])
                    i += 2
                    continue
                buf.append(ch)
                i += 1
            toks.append(_Token(_T.STRING, src[start:i], start, "".join(buf)))
            continue
        if c == "$" or _is_name_start(c):
            i += 1
            if c == "$" and (i >= n or not _is_name_start(src[i])):
                raise ExpressionError(
                    "'$' must start a global reference such as $Record", start, src
                )
            while i < n and _is_name_char(src[i]):
                i += 1
            toks.append(_Token(_T.NAME, src[start:i], start))
            continue
        op = next((o for o in _OPS if src.startswith(o, i)), None)
        if op is None:
            raise ExpressionError(f"unexpected character {c!r}", i, src)
        toks.append(_Token(_T.OP, op, i))
        i += len(op)
    toks.append(_Token(_T.EOF, "", n))
    return toks


# ------------------------------------------------------------------ parser

_CMP = {"==": "==", "=": "==", "!=": "!=", "<>": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
_PREC_OR, _PREC_AND, _PREC_NOT, _PREC_CMP, _PREC_SUM, _PREC_TERM, _PREC_UNARY = 1, 2, 3, 4, 5, 6, 7
_GLOBALS = ("$Record", "$Record__Prior", "$Event")
#: Reserved words (case-insensitive); they cannot name variables.
KEYWORDS = frozenset({"true", "false", "null", "and", "or", "not"})
MAX_DEPTH = 64
MAX_LENGTH = 4096


def _infix(tok: _Token) -> tuple[str, int] | None:
    """Canonical operator and precedence of an infix token, if it is one."""
    if tok.kind is _T.OP:
        if tok.text in _CMP:
            return _CMP[tok.text], _PREC_CMP
        if tok.text == "||":
            return "||", _PREC_OR
        if tok.text == "&&":
            return "&&", _PREC_AND
        if tok.text in ("+", "-"):
            return tok.text, _PREC_SUM
        if tok.text in ("*", "/", "%"):
            return tok.text, _PREC_TERM
    if tok.kind is _T.NAME:
        low = tok.text.lower()
        if low == "or":
            return "||", _PREC_OR
        if low == "and":
            return "&&", _PREC_AND
    return None


class _Parser:
    def __init__(self, src: str) -> None:
        self.src = src
        self.toks = _tokenize(src)
        self.i = 0
        self.depth = 0

    def peek(self) -> _Token:
        return self.toks[self.i]

    def take(self) -> _Token:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def fail(self, message: str, tok: _Token) -> ExpressionError:
        return ExpressionError(message, tok.pos, self.src)

    def expect_op(self, text: str) -> _Token:
        tok = self.take()
        if tok.kind is not _T.OP or tok.text != text:
            shown = tok.text or tok.kind.value
            raise self.fail(f"expected {text!r} but found {shown!r}", tok)
        return tok

    def parse(self) -> Expr:
        if not self.src.strip():
            raise ExpressionError("empty expression", 0, self.src)
        expr = self.expr(0)
        tok = self.peek()
        if tok.kind is not _T.EOF:
            raise self.fail(f"unexpected {tok.text!r} after complete expression", tok)
        return expr

    def expr(self, min_prec: int) -> Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail("expression nests too deeply", self.peek())
        left = self.prefix()
        while True:
            tok = self.peek()
            info = _infix(tok)
            if info is None or info[1] <= min_prec:
                break
            op, prec = info
            self.take()
            right = self.expr(prec)
            after = _infix(self.peek())
            if prec == _PREC_CMP and after is not None and after[1] == _PREC_CMP:
                raise self.fail("comparisons cannot be chained; use && between them", self.peek())
            left = Binary(op, left, right)
        self.depth -= 1
        return left

    def prefix(self) -> Expr:
        tok = self.take()
        if tok.kind is _T.NUMBER:
            return _number(tok.text)
        if tok.kind is _T.STRING:
            if tok.value is None:
                raise InvariantError("a string token without its value")
            return Literal(LiteralKind.STRING, tok.value)
        if tok.kind is _T.OP:
            if tok.text == "(":
                inner = self.expr(0)
                self.expect_op(")")
                return inner
            if tok.text == "!":
                return Unary("!", self.expr(_PREC_NOT))
            if tok.text == "-":
                # The operand is a primary: "-x * y" is "(-x) * y".
                return _negate(self.expr(_PREC_TERM))
            raise self.fail(f"unexpected {tok.text!r}", tok)
        if tok.kind is _T.NAME:
            return self.name(tok)
        raise self.fail("unexpected end of expression", tok)

    def name(self, tok: _Token) -> Expr:
        low = tok.text.lower()
        if low == "true":
            return Literal(LiteralKind.BOOLEAN, True)
        if low == "false":
            return Literal(LiteralKind.BOOLEAN, False)
        if low == "null":
            return Literal(LiteralKind.NULL, None)
        if low == "not":
            return Unary("!", self.expr(_PREC_NOT))
        if low in ("and", "or"):
            raise self.fail(f"unexpected operator {tok.text!r}", tok)
        nxt = self.peek()
        if nxt.kind is _T.OP and nxt.text == "(":
            return self.call(tok)
        if tok.text.startswith("$") and tok.text not in _GLOBALS:
            raise self.fail(
                f"unknown global {tok.text!r}; expected one of {', '.join(_GLOBALS)}", tok
            )
        path: list[str] = []
        while self.peek().kind is _T.OP and self.peek().text == ".":
            self.take()
            seg = self.take()
            if seg.kind is not _T.NAME or seg.text.startswith("$"):
                raise self.fail("expected a field name after '.'", seg)
            path.append(seg.text)
        return Ref(tok.text, tuple(path), tok.pos)

    def call(self, tok: _Token) -> Expr:
        name = tok.text.upper()
        if name not in FUNCTIONS:
            raise self.fail(f"unknown function {tok.text!r}", tok)
        self.expect_op("(")
        args: list[Expr] = []
        if not (self.peek().kind is _T.OP and self.peek().text == ")"):
            while True:
                args.append(self.expr(0))
                if self.peek().kind is _T.OP and self.peek().text == ",":
                    self.take()
                    continue
                break
        self.expect_op(")")
        lo, hi = FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo}-{hi}")
            raise self.fail(f"{name} takes {want} argument(s), got {len(args)}", tok)
        return Call(name, tuple(args), tok.pos)


def _number(text: str) -> Literal:
    if "." in text:
        try:
            return Literal(LiteralKind.NUMBER, Decimal(text))
        except InvalidOperation:  # pragma: no cover - the tokenizer only admits digits
            raise ExpressionError(f"malformed number {text!r}", 0, text) from None
    return Literal(LiteralKind.NUMBER, int(text))


def _negate(operand: Expr) -> Expr:
    # Fold "-<number>" into a literal so "-1" and "- 1" share one canonical form.
    if isinstance(operand, Literal) and operand.kind is LiteralKind.NUMBER:
        if not isinstance(operand.value, int | Decimal) or isinstance(operand.value, bool):
            raise InvariantError("a number literal without a numeric value")
        return Literal(LiteralKind.NUMBER, -operand.value)
    return Unary("-", operand)


def parse_expression(text: str) -> Expr:
    """Parse ``text`` into an AST.

    Raises:
        ExpressionError: the text is malformed; ``position`` locates the problem.
    """
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters", MAX_LENGTH, text)
    return _Parser(text).parse()


# ---------------------------------------------------------------- unparse

_BIN_PREC = {
    "||": _PREC_OR,
    "&&": _PREC_AND,
    "==": _PREC_CMP,
    "!=": _PREC_CMP,
    "<": _PREC_CMP,
    "<=": _PREC_CMP,
    ">": _PREC_CMP,
    ">=": _PREC_CMP,
    "+": _PREC_SUM,
    "-": _PREC_SUM,
    "*": _PREC_TERM,
    "/": _PREC_TERM,
    "%": _PREC_TERM,
}


def _prec(e: Expr) -> int:
    if isinstance(e, Binary):
        return _BIN_PREC[e.op]
    if isinstance(e, Unary):
        return _PREC_NOT if e.op == "!" else _PREC_UNARY
    if isinstance(e, Literal) and e.kind is LiteralKind.NUMBER and _is_negative(e.value):
        return _PREC_UNARY
    return 99


def _is_negative(v: object) -> bool:
    return isinstance(v, int | Decimal) and not isinstance(v, bool) and v < 0


def _fmt_number(v: int | Decimal) -> str:
    if isinstance(v, int):
        return str(v)
    text = format(v.normalize(), "f")
    return text if "." in text else text + ".0"


def _fmt_string(s: str) -> str:
    out = s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t")
    return f"'{out}'"


def unparse(e: Expr) -> str:
    """Canonical source text of ``e`` (``parse_expression(unparse(e)) == e``)."""
    if isinstance(e, Literal):
        if e.kind is LiteralKind.NULL:
            return "null"
        if e.kind is LiteralKind.BOOLEAN:
            return "true" if e.value else "false"
        if e.kind is LiteralKind.STRING:
            if not isinstance(e.value, str):
                raise InvariantError("a string literal without a string value")
            return _fmt_string(e.value)
        if not isinstance(e.value, int | Decimal) or isinstance(e.value, bool):
            raise InvariantError("a number literal without a numeric value")
        return _fmt_number(e.value)
    if isinstance(e, Ref):
        return e.dotted()
    if isinstance(e, Call):
        return f"{e.name}({', '.join(unparse(a) for a in e.args)})"
    if isinstance(e, Unary):
        inner = unparse(e.operand)
        bound = _PREC_CMP if e.op == "!" else _PREC_TERM
        if _prec(e.operand) <= bound:
            inner = f"({inner})"
        return f"{e.op}{inner}"
    p = _BIN_PREC[e.op]
    left, right = unparse(e.left), unparse(e.right)
    # Left-associative: a left child binds at >= p, a right child strictly tighter.
    # Comparisons do not chain, so a comparison child of a comparison needs parentheses.
    if _prec(e.left) < p or (p == _PREC_CMP and _prec(e.left) == p):
        left = f"({left})"
    if _prec(e.right) <= p:
        right = f"({right})"
    return f"{left} {e.op} {right}"


def references(e: Expr) -> tuple[Ref, ...]:
    """Every reference in ``e``, in source order (duplicates kept)."""
    out: list[Ref] = []

    def walk(x: Expr) -> None:
        if isinstance(x, Ref):
            out.append(x)
        elif isinstance(x, Unary):
            walk(x.operand)
        elif isinstance(x, Binary):
            walk(x.left)
            walk(x.right)
        elif isinstance(x, Call):
            for a in x.args:
                walk(a)

    walk(e)
    return tuple(out)
