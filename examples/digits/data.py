"""The digits dataset (it ships inside scikit-learn: nothing is downloaded) and its fixed split."""

from __future__ import annotations

import numpy as np

# The split is part of the contract of the example: tests classify the held-out rows.
SPLIT_SEED = 0
VAL_FRACTION = 0.15
TEST_FRACTION = 0.15


def load_digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Return ``{"train": (X, y), "val": (X, y), "test": (X, y)}``; X is float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(len(x) * TEST_FRACTION)
    n_val = int(len(x) * VAL_FRACTION)
    test, val, train = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}
