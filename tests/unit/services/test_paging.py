"""List pages bounded by bytes as well as by count (services.paging)."""

from __future__ import annotations

import pytest

from services.errors import OutOfRangeError
from services.paging import fit_page
from services.proto import runtime_v1

#: A keyset-paged "service": runs r00..r29, the i-th with a title of SIZES[i] bytes.
SIZES = [50, 400, 50, 50, 900, 50, 50, 50, 700, 50] * 3
DEFAULT_SIZE = 10


def _service(sizes: list[int]):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    async def list_runs(after: int, size: int) -> runtime_v1.ListRunsResponse:
        calls.append(size)
        size = size or DEFAULT_SIZE
        page = list(range(after, min(after + size, len(sizes))))
        response = runtime_v1.ListRunsResponse(
            runs=[
                runtime_v1.FlowRun(flow_run_id=f"r{i:02d}", trace_id="t" * sizes[i]) for i in page
            ]
        )
        if page and page[-1] + 1 < len(sizes):
            response.next_page_token = str(page[-1] + 1)
        return response

    return list_runs, calls


async def test_pages_fit_the_budget_and_resume_exactly() -> None:
    list_runs, calls = _service(SIZES)
    budget, token, seen, pages = 1_200, "", [], 0
    while True:
        after = int(token or 0)

        async def fetch(size: int, after: int = after) -> runtime_v1.ListRunsResponse:
            return await list_runs(after, size)

        page = await fit_page(fetch, lambda r: r.runs, page_size=0, budget=budget, what="flow run")
        assert page.ByteSize() <= budget
        seen += [r.flow_run_id for r in page.runs]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"r{i:02d}" for i in range(len(SIZES))]
    assert pages > len(SIZES) // DEFAULT_SIZE  # some pages were cut by bytes
    assert 0 in calls and any(c > 0 for c in calls)


async def test_a_page_that_fits_is_read_once() -> None:
    list_runs, calls = _service([10] * 5)

    async def fetch(size: int) -> runtime_v1.ListRunsResponse:
        return await list_runs(0, size)

    page = await fit_page(fetch, lambda r: r.runs, page_size=3, budget=4096, what="flow run")
    assert len(page.runs) == 3
    assert calls == [3]


async def test_one_item_over_the_budget_is_out_of_range() -> None:
    list_runs, _ = _service([5_000])

    async def fetch(size: int) -> runtime_v1.ListRunsResponse:
        return await list_runs(0, size)

    with pytest.raises(OutOfRangeError) as info:
        await fit_page(fetch, lambda r: r.runs, page_size=0, budget=1_000, what="flow run")
    assert info.value.reason == "item_too_large"
