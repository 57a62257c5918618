"""List pages bounded by bytes as well as by count.

A list RPC answers ``page_size`` items (or its default), but a page of large items can
exceed the message size limit — the server's (``FLOW_GRPC_MAX_MESSAGE_BYTES``) or a
default client's (4 MiB) — and the client would see a transport error instead of a page.
:func:`fit_page` asks the service for a page, and when the encoded response is over the
byte budget asks again for exactly as many items as fit: the service's own keyset token
then resumes after the last item returned, so paging stays exact without any
byte-aware code in the service or its queries. An item that alone exceeds the budget
is ``OUT_OF_RANGE`` (nothing smaller can be returned).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from google.protobuf.message import Message

from services.config import ServiceConfig
from services.errors import OutOfRangeError

__all__ = ["DEFAULT_CLIENT_MAX_BYTES", "fit_page", "response_budget"]

#: gRPC's default receive limit of a client that sets none.
DEFAULT_CLIENT_MAX_BYTES = 4 * 1024 * 1024
#: Attempts to shrink a page before giving up (items may change between two reads).
_MAX_ATTEMPTS = 4
#: Bytes of framing per repeated item (tag + length varint), an upper bound.
_ITEM_OVERHEAD = 6

M = TypeVar("M", bound=Message)


def response_budget(cfg: ServiceConfig) -> int:
    """The largest response a list RPC of ``cfg``'s service sends (bytes)."""
    return min(cfg.grpc_max_message_bytes, DEFAULT_CLIENT_MAX_BYTES)


def _fitting(response: Message, items: Sequence[Message], budget: int) -> int:
    """How many leading ``items`` fit in ``budget`` with the rest of ``response``."""
    item_bytes = [m.ByteSize() + _ITEM_OVERHEAD for m in items]
    rest = max(0, response.ByteSize() - sum(item_bytes))
    used, count = rest, 0
    for size in item_bytes:
        if used + size > budget:
            break
        used += size
        count += 1
    return count


async def fit_page(
    fetch: Callable[[int], Awaitable[M]],
    items: Callable[[M], Sequence[Message]],
    *,
    page_size: int,
    budget: int,
    what: str,
) -> M:
    """The response of ``fetch(page_size)``, re-read with fewer items until it fits.

    Args:
        fetch: builds the response for a page size (0 = the service's default).
        items: the repeated items of a response, in page order.
        page_size: the size the client asked for.
        budget: the largest encoded response allowed (bytes).
        what: the item kind, for the error.

    Raises:
        OutOfRangeError: one item alone exceeds ``budget``.
    """
    size = page_size
    for _ in range(_MAX_ATTEMPTS):
        response = await fetch(size)
        if response.ByteSize() <= budget:
            return response
        page = items(response)
        fitting = _fitting(response, page, budget)
        if fitting == 0:
            break
        size = min(fitting, len(page) - 1) if len(page) > 1 else fitting
    raise OutOfRangeError(
        f"a single {what} exceeds the response size limit of {budget} bytes",
        reason="item_too_large",
        attributes={"max_message_bytes": str(budget)},
    )
