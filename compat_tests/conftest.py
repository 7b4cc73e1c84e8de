"""The compat tests start from the same clean, launcher-free environment as the unit tests, and get
their tiers from the same table (tests/conftest.py)."""

from pathlib import Path

import pytest

from tests.conftest import clean_launcher_env, mark_tiers  # noqa: F401  (an autouse fixture)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items, Path(__file__).parent)
