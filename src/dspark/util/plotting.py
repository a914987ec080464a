"""matplotlib without a screen: every plot dspark writes goes through `pyplot()`."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (PNG files, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
