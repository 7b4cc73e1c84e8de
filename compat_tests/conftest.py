"""The compat tests start from the same clean, launcher-free environment as the unit tests, and get
their tiers and xdist groups the same way (tests/conftest.py)."""

from tests.conftest import clean_launcher_env, pytest_collection_modifyitems  # noqa: F401  (autouse fixture, hook)
