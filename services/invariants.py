"""Internal invariant checks that survive ``python -O``.

Production code never uses ``assert`` for a runtime check (``-O`` strips it, and an
``AssertionError`` says nothing about what broke). A condition the code relies on but that
only a bug can violate raises :class:`InvariantError` explicitly::

    if plan is None:
        raise InvariantError("a mutation step produced no lock plan")

Client input is never checked this way (that is ``InvalidArgumentError`` and friends):
an :class:`InvariantError` reaches a caller as ``INTERNAL`` with no detail, and is logged.
``tests/unit/test_no_asserts.py`` keeps ``assert`` out of the service packages.
"""

from __future__ import annotations

__all__ = ["InvariantError"]


class InvariantError(RuntimeError):
    """A broken internal invariant (a bug), never a client error."""
