"""protofl's log lines: the ``protofl`` logger and the handler that shows them when the
application configured none (a bottom-layer module: the engine and the data fetcher both
log through it)."""
from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("protofl")


def ensure_log_handler() -> None:
    """Make protofl's INFO lines visible when the application configured no logging. The
    handler protofl adds then owns its lines: they do not also reach the root logger, which a
    library may configure later (a module-level ``logging.warning`` call does: every line
    would then print twice)."""
    if not LOGGER.hasHandlers():
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        LOGGER.addHandler(h)
        LOGGER.propagate = False
    if LOGGER.level == logging.NOTSET:  # a level set on "protofl" by the application wins
        LOGGER.setLevel(logging.INFO)
