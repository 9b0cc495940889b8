"""The example model: a small MLP over 8x8 digit images (64 features, 10 classes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

N_FEATURES = 64
N_CLASSES = 10


def build_model(config: dict[str, Any]) -> nn.Module:
    """Build the network from its architecture config (stored in every checkpoint)."""
    hidden = int(config.get("hidden", 128))
    dropout = float(config.get("dropout", 0.0))
    return nn.Sequential(
        nn.Linear(N_FEATURES, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, N_CLASSES),
    )


def load_model_file(path: str, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Load ``model.pt`` (``{"state_dict", "config"}``) into an eval-mode module."""
    payload = torch.load(path, map_location=map_location, weights_only=True)
    model = build_model(payload["config"])
    model.load_state_dict(payload["state_dict"])
    model.eval()
    return model, payload["config"]
