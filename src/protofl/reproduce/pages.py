"""What a published page says about itself: the machine-readable summary that
``protofl reproduce`` writes into every ``table.md`` (its table, data, seeds and
verdicts), read back by the index of pages and by the check that a folder holds one
variant's pages only."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from ..errors import InputError
from .spec import TableSpec

SUMMARY = "protofl-reproduce"  # the marker of the page's machine-readable verdicts


def read_summary(page: Path) -> Optional[dict]:
    """The verdicts a page carries (None: a page made before pages carried them)."""
    m = re.search(rf"<!-- {SUMMARY} (\{{.*\}}) -->", page.read_text(encoding="utf-8"))
    if m is None:
        return None
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError as e:
        raise InputError(f"{page}: its {SUMMARY} summary is not valid JSON ({e.msg}); regenerate the page") from None


def page_data(s: dict, spec: Optional[TableSpec]) -> str:
    """The data a page ran on; a page from before pages named it ran on what is now
    ``--data substitute`` (the paper's own for a table with one variant)."""
    if s.get("data"):
        return s["data"]
    return "paper" if spec is not None and not spec.has_paper_data else "substitute"


# ---------------------------------------------------------------------------------------
# quotes: a verdict in the docs is a block filled from the page that carries it
# ---------------------------------------------------------------------------------------
QUOTE = re.compile(r"(<!-- verdicts: (\S+) ([\w.-]+) -->)(.*?)(<!-- /verdicts -->)", re.S)


def quote(s: dict, claim: str, where: str) -> str:
    """A claim's verdicts as a page's summary carries them, one per setting: "*not shown*
    on Dir(0.3) (+0.00 pts (90 % CI -0.31 to +0.32), p = 0.978)"."""
    found = [c for c in s.get("claims", []) if c.get("id") == claim]
    if not found:
        raise InputError(f"{where}: the page has no claim {claim!r} (its claims: "
                         f"{', '.join(sorted({c.get('id', '?') for c in s.get('claims', [])}))})")
    return "; ".join(f"*{c['label']}* on {c['setting']}" + (f" ({c['line']})" if c.get("line") else "")
                     for c in found)


def fill_quotes(text: str, root: Path, where: str = "") -> str:
    """``text`` with every ``<!-- verdicts: PAGE CLAIM -->...<!-- /verdicts -->`` block
    filled from the summary PAGE carries (PAGE relative to ``root``, the repository): the
    docs quote a verdict only through such a block, so a page made again cannot leave a
    stale copy behind (``protofl reproduce quotes --write``; tests/test_page_rules.py)."""
    def fill(m: re.Match) -> str:
        page = Path(root) / m.group(2)
        at = f"{where}: {m.group(1)}"
        if not page.is_file():
            raise InputError(f"{at}: no page {m.group(2)}")
        s = read_summary(page)
        if s is None:
            raise InputError(f"{at}: {m.group(2)} carries no verdicts")
        return f"{m.group(1)}{quote(s, m.group(3), at)}{m.group(5)}"

    return QUOTE.sub(fill, text)
