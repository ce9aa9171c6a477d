"""Numbers read from the logs: a value as a float, (x, y) series, the centred moving average (no HTML,
no matplotlib).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def series(rows: list[dict] | None, key: str, x: str = "step"):
    """(x, y) arrays of the rows that hold numbers under both keys, in x order."""
    points = sorted(
        (num(r.get(x)), num(r.get(key)))
        for r in rows or ()
        if num(r.get(x)) is not None and num(r.get(key)) is not None
    )
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def smooth(y, window: int):
    """Centred moving average over the finite values in [i - window//2, i + window//2] (shorter at
    the ends). Centred, so a trend is not shifted the way an exponential average lags it.

        out[i] = mean(y[j] for j in range(i - h, i + h + 1) if 0 <= j < len(y) and isfinite(y[j]))
    """
    y = np.asarray(y, dtype=float)
    h = window // 2
    finite = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, y, 0.0))])  # csum[k] = sum of y[:k]
    ccount = np.concatenate([[0], np.cumsum(finite)])
    lo = np.clip(np.arange(len(y)) - h, 0, len(y))
    hi = np.clip(np.arange(len(y)) + h + 1, 0, len(y))
    count = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / count, np.nan)


def logged(history: list[dict] | None, key: str) -> bool:
    return len(series(history, key)[0]) > 0


def first_of(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)
