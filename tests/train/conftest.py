"""Fixtures of the trainer tests (helpers live in train_helpers.py)."""

import pytest
from train_helpers import synthetic_docs


@pytest.fixture
def docs():
    return synthetic_docs(40, seed=1)
