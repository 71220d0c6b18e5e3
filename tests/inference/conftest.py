"""A small trained digits CNN exported once per session, with its int8 variants (real exports, real ORT)."""

import numpy as np
import pytest
import torch

from fedge.app.digits import digits_split
from fedge.app.task import DigitsCNN


def _trained_cnn() -> DigitsCNN:
    torch.manual_seed(0)
    model = DigitsCNN()
    features, labels = digits_split("train")
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(4):
        order = torch.randperm(len(labels))
        for i in range(0, len(labels), 32):
            rows = order[i : i + 32]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(features[rows]), labels[rows]).backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="session")
def cnn() -> DigitsCNN:
    return _trained_cnn()


@pytest.fixture(scope="session")
def digits_test() -> tuple[np.ndarray, np.ndarray]:
    features, labels = digits_split("test")
    return features.numpy(), labels.numpy()


@pytest.fixture(scope="session")
def variants(cnn, digits_test, tmp_path_factory):
    """``{variant: (path, manifest)}`` for fp32, int8-static and int8-dynamic of the trained CNN."""
    from fedge.server.export import export_variants

    train_x, _ = digits_split("train")
    out = tmp_path_factory.mktemp("variants")
    return export_variants(
        cnn,
        digits_test[0][:2],
        out,
        calibration=train_x[:128].numpy(),
        labelled=digits_test,
        version="r3",
        round=3,
    )
