"""Pure evaluator for Flow expression ASTs.

Values: ``None`` (null), ``bool``, ``int``/``Decimal`` (numbers, never
``float``: arithmetic is exact and platform independent), ``str``, mappings
(records) and sequences (collections). ``evaluate`` has no side effects, reads
only ``env`` and uses a fixed decimal context, so one input always gives one
output.

Semantics in brief:

* a missing root name is an error; a missing field of a record is ``null``;
* arithmetic with ``null`` gives ``null``; ``+`` also concatenates two strings;
  ``/`` always yields a ``Decimal``; division or modulo by zero is an error;
* ``==``/``!=`` compare any two values (``null == null`` is true); ordering
  (``<`` …) needs two numbers or two strings, ``null`` makes it false;
* ``&&``/``||`` short-circuit and treat ``null`` as false; any other
  non-boolean operand is an error; ``!`` likewise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from decimal import Context, Decimal, DivisionByZero, InvalidOperation
from typing import Any

from .expressions import Binary, Expr, Literal, Ref, Unary

__all__ = ["Evaluator", "ExpressionEvalError", "evaluate", "evaluator"]

#: An expression made into a function of its environment (:func:`evaluator`).
Evaluator = Callable[[Mapping[str, Any]], Any]

_CTX = Context(prec=34)  # IEEE decimal128 precision, fixed for determinism


class ExpressionEvalError(ValueError):
    """An expression could not be evaluated against the given environment."""


def _num(v: Any) -> bool:
    t = type(v)
    if t is int or t is Decimal:  # the common case, without the union isinstance
        return True
    return isinstance(v, int | Decimal) and not isinstance(v, bool)


def _truth(v: Any, what: str) -> bool:
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    raise ExpressionEvalError(f"{what} needs a boolean, got {type(v).__name__}")


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Decimal):
        out = format(v.normalize(_CTX), "f")
        return out
    if isinstance(v, int | str):
        return str(v)
    raise ExpressionEvalError(f"TEXT cannot format a {type(v).__name__}")


def _need_str(v: Any, fn: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise ExpressionEvalError(f"{fn} needs text, got {type(v).__name__}")


def _arith(op: str, a: Any, b: Any) -> Any:
    if a is None or b is None:
        return None
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        return a + b
    if not (_num(a) and _num(b)):
        raise ExpressionEvalError(
            f"'{op}' needs numbers, got {type(a).__name__} and {type(b).__name__}"
        )
    try:
        if op == "+":
            return _CTX.add(a, b) if isinstance(a, Decimal) or isinstance(b, Decimal) else a + b
        if op == "-":
            return (
                _CTX.subtract(a, b) if isinstance(a, Decimal) or isinstance(b, Decimal) else a - b
            )
        if op == "*":
            return (
                _CTX.multiply(a, b) if isinstance(a, Decimal) or isinstance(b, Decimal) else a * b
            )
        if b == 0:
            raise ExpressionEvalError("division by zero")
        if op == "/":
            return _CTX.divide(Decimal(a), Decimal(b))
        if isinstance(a, int) and isinstance(b, int):
            return a % b
        return _CTX.remainder(Decimal(a), Decimal(b))
    except (DivisionByZero, InvalidOperation) as exc:
        raise ExpressionEvalError(f"arithmetic error in '{op}'") from exc


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        return _equal(a, b)
    if op == "!=":
        return not _equal(a, b)
    if a is None or b is None:
        return False
    if not ((_num(a) and _num(b)) or (isinstance(a, str) and isinstance(b, str))):
        raise ExpressionEvalError(f"'{op}' needs two numbers or two strings")
    if op == "<":
        return bool(a < b)
    if op == "<=":
        return bool(a <= b)
    if op == ">":
        return bool(a > b)
    return bool(a >= b)


def _equal(a: Any, b: Any) -> bool:
    # bool is an int subclass in Python; keep true != 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    return bool(a == b)


def _minmax(args: list[Any], pick: Callable[[Any, Any], bool], fn: str) -> Any:
    vals = [a for a in args if a is not None]
    if not vals:
        return None
    if not all(_num(v) for v in vals):
        raise ExpressionEvalError(f"{fn} needs numbers")
    best = vals[0]
    for v in vals[1:]:
        if pick(v, best):
            best = v
    return best


def _call(name: str, args: list[Any]) -> Any:
    if name == "UPPER":
        s = _need_str(args[0], name)
        return None if s is None else s.upper()
    if name == "LOWER":
        s = _need_str(args[0], name)
        return None if s is None else s.lower()
    if name == "TRIM":
        s = _need_str(args[0], name)
        return None if s is None else s.strip()
    if name == "LEN":
        v = args[0]
        if v is None:
            return 0
        if isinstance(v, str | Sequence) and not isinstance(v, bytes):
            return len(v)
        raise ExpressionEvalError("LEN needs text or a collection")
    if name == "CONCAT":
        return "".join(_text(a) for a in args)
    if name in ("CONTAINS", "BEGINS", "ENDS"):
        hay, needle = _need_str(args[0], name), _need_str(args[1], name)
        if hay is None or needle is None:
            return False
        if name == "CONTAINS":
            return needle in hay
        return hay.startswith(needle) if name == "BEGINS" else hay.endswith(needle)
    if name == "TEXT":
        return _text(args[0])
    if name == "ISBLANK":
        v = args[0]
        return v is None or (isinstance(v, str) and v.strip() == "")
    if name == "ABS":
        v = args[0]
        if v is None:
            return None
        if not _num(v):
            raise ExpressionEvalError("ABS needs a number")
        return abs(v)
    if name == "MIN":
        return _minmax(args, lambda x, y: bool(x < y), name)
    if name == "MAX":
        return _minmax(args, lambda x, y: bool(x > y), name)
    raise ExpressionEvalError(f"unknown function {name}")  # pragma: no cover - parser rejects


def _resolve(ref: Ref, env: Mapping[str, Any]) -> Any:
    if ref.root not in env:
        raise ExpressionEvalError(f"unknown reference {ref.root!r}")
    value = env[ref.root]
    for seg in ref.path:
        if value is None:
            return None
        if type(value) is not dict and not isinstance(value, Mapping):
            raise ExpressionEvalError(
                f"{ref.dotted()}: cannot read field {seg!r} of a {type(value).__name__}"
            )
        value = value.get(seg)
    return value


def evaluate(expr: Expr, env: Mapping[str, Any]) -> Any:
    """Evaluate ``expr`` against ``env`` (variable name → value; ``"$Record"`` → record).

    Raises:
        ExpressionEvalError: a type error, a missing root name, or division by zero.
    """
    if isinstance(expr, Literal):
        return expr.value
    if isinstance(expr, Ref):
        return _resolve(expr, env)
    if isinstance(expr, Unary):
        v = evaluate(expr.operand, env)
        if expr.op == "!":
            return not _truth(v, "'!'")
        if v is None:
            return None
        if not _num(v):
            raise ExpressionEvalError("unary '-' needs a number")
        return -v
    if isinstance(expr, Binary):
        if expr.op == "&&":
            return _truth(evaluate(expr.left, env), "'&&'") and _truth(
                evaluate(expr.right, env), "'&&'"
            )
        if expr.op == "||":
            return _truth(evaluate(expr.left, env), "'||'") or _truth(
                evaluate(expr.right, env), "'||'"
            )
        a, b = evaluate(expr.left, env), evaluate(expr.right, env)
        if expr.op in ("+", "-", "*", "/", "%"):
            return _arith(expr.op, a, b)
        return _compare(expr.op, a, b)
    if expr.name == "IF":
        cond = _truth(evaluate(expr.args[0], env), "IF")
        return evaluate(expr.args[1] if cond else expr.args[2], env)
    return _call(expr.name, [evaluate(a, env) for a in expr.args])


def evaluator(expr: Expr) -> Evaluator:
    r"""``expr`` as a function of ``env`` that :func:`evaluate`\ s it — same helpers, same
    order of evaluation, same values and errors — with the dispatch on each node's type
    and operator decided once, here, instead of at every evaluation. Built from closures
    over the tree (no generated source); a plan's expression texts are made into
    evaluators once per worker (``worker.executor``).

    ``evaluate`` stays the reference: a property test runs both on generated trees.
    """
    if isinstance(expr, Literal):
        value = expr.value
        return lambda env: value
    if isinstance(expr, Ref):
        if expr.path:
            ref = expr
            return lambda env: _resolve(ref, env)
        root = expr.root

        def variable(env: Mapping[str, Any]) -> Any:
            if root not in env:
                raise ExpressionEvalError(f"unknown reference {root!r}")
            return env[root]

        return variable
    if isinstance(expr, Unary):
        operand = evaluator(expr.operand)
        if expr.op == "!":
            return lambda env: not _truth(operand(env), "'!'")

        def negate(env: Mapping[str, Any]) -> Any:
            v = operand(env)
            if v is None:
                return None
            if not _num(v):
                raise ExpressionEvalError("unary '-' needs a number")
            return -v

        return negate
    if isinstance(expr, Binary):
        op, left, right = expr.op, evaluator(expr.left), evaluator(expr.right)
        if op == "&&":
            return lambda env: _truth(left(env), "'&&'") and _truth(right(env), "'&&'")
        if op == "||":
            return lambda env: _truth(left(env), "'||'") or _truth(right(env), "'||'")
        if op in ("+", "-", "*", "/", "%"):
            return lambda env: _arith(op, left(env), right(env))
        return lambda env: _compare(op, left(env), right(env))
    if expr.name == "IF":
        cond, then, otherwise = (evaluator(a) for a in expr.args)
        return lambda env: then(env) if _truth(cond(env), "IF") else otherwise(env)
    name, args = expr.name, tuple(evaluator(a) for a in expr.args)
    return lambda env: _call(name, [a(env) for a in args])
