"""Where ecoserve keeps what it builds on first use: converted GGUF checkpoints and compiled kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$ECOSERVE_CACHE, else $XDG_CACHE_HOME/ecoserve, else ~/.cache/ecoserve."""
    if os.environ.get("ECOSERVE_CACHE"):
        return Path(os.environ["ECOSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ecoserve"
