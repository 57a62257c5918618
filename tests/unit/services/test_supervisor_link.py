"""``services.supervisor_link``: message lines on a supervised child's stdin."""

from __future__ import annotations

import pytest

from services.supervisor_link import MAX_MESSAGE_BYTES, LineDecoder, encode_message


def test_messages_round_trip_across_arbitrary_chunk_boundaries() -> None:
    lines = encode_message({"kind": "resolved_run", "org_id": "o1", "flow_run_id": "r1"})
    lines += encode_message({"kind": "resolved_run", "org_id": "o2", "flow_run_id": "r2"})
    decoder = LineDecoder()
    got = []
    for i in range(len(lines)):  # one byte at a time
        got += decoder.feed(lines[i : i + 1])
    assert got == [
        {"kind": "resolved_run", "org_id": "o1", "flow_run_id": "r1"},
        {"kind": "resolved_run", "org_id": "o2", "flow_run_id": "r2"},
    ]
    assert LineDecoder().feed(lines) == got  # and all at once


def test_malformed_and_non_object_lines_are_dropped_and_the_next_one_is_read() -> None:
    decoder = LineDecoder()
    assert decoder.feed(b"not json\n[1,2]\n\n" + encode_message({"k": 1})) == [{"k": 1}]


def test_an_oversized_line_is_dropped_without_buffering_it_whole() -> None:
    decoder = LineDecoder()
    assert decoder.feed(b"x" * (MAX_MESSAGE_BYTES + 10)) == []
    assert decoder.feed(b"y" * MAX_MESSAGE_BYTES) == []  # still the same line: skipped
    assert decoder.feed(b"\n" + encode_message({"k": 2})) == [{"k": 2}]


def test_a_message_too_long_to_send_is_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        encode_message({"k": "z" * MAX_MESSAGE_BYTES})
