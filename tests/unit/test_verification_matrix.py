"""The verification matrix lists every §22 item and names only tests that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "docs" / "verification-matrix.md"
ROW_RE = re.compile(r"^\| (V22\.(\d)-\d{2}) \| (.+?) \| (.*?) \|$")
EXPECTED_PER_SECTION = {"1": 16, "2": 30, "3": 12, "4": 15, "5": 23, "6": 12, "7": 9, "8": 14}


def _rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for line in MATRIX.read_text(encoding="utf-8").splitlines():
        m = ROW_RE.match(line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3), m.group(4)))
    return rows


def _node_ids(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_matrix_lists_all_131_items_grouped_by_section() -> None:
    rows = _rows()
    assert len(rows) == 131
    assert len({r[0] for r in rows}) == 131, "duplicate row ids"
    per_section: dict[str, int] = {}
    for _, section, _, _ in rows:
        per_section[section] = per_section.get(section, 0) + 1
    assert per_section == EXPECTED_PER_SECTION


def test_every_named_test_id_is_collected_by_pytest() -> None:
    ids = sorted({nid for row in _rows() for nid in _node_ids(row[3])})
    for nid in ids:
        assert nid.startswith("tests/"), f"{nid}: node ids are relative to the repository root"
        assert "::" in nid, f"{nid}: name a test, not a file"
    if not ids:
        return
    # pytest reports "ERROR: not found: <id>" and exits non-zero for any id it cannot collect.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"matrix names tests pytest cannot collect:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    )
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    for nid in ids:
        assert any(
            c == nid or c.startswith(nid + "[") or c.startswith(nid + "::") for c in collected
        ), nid
