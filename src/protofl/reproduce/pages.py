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
