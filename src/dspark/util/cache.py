"""Where dspark keeps what it computes once per machine (dequantised models, SPS profiles)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$DSPARK_CACHE_DIR, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark."""
    if os.environ.get("DSPARK_CACHE_DIR"):
        return Path(os.environ["DSPARK_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark"
