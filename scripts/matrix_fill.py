"""Fill rows of docs/verification-matrix.md: ``matrix_fill.py V22.1-01 tests/x.py::test_a [...]``.

Appends node ids to the row's *Tests* cell (keeping existing ones, no duplicates).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MATRIX = Path(__file__).resolve().parents[1] / "docs" / "verification-matrix.md"
ROW = re.compile(r"^(\| (V22\.\d-\d{2}) \| .+? \| )(.*?) \|$")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    row_id, ids = argv[0], argv[1:]
    lines = MATRIX.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        m = ROW.match(line)
        if m and m.group(2) == row_id:
            existing = re.findall(r"`([^`]+)`", m.group(3))
            merged = existing + [x for x in ids if x not in existing]
            lines[i] = m.group(1) + "<br>".join(f"`{x}`" for x in merged) + " |"
            MATRIX.write_text("\n".join(lines), encoding="utf-8")
            return 0
    print(f"no row {row_id}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
