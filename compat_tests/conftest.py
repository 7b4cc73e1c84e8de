"""The compat tests start from the same clean, launcher-free environment as the unit tests."""

from tests.conftest import clean_launcher_env  # noqa: F401  (an autouse fixture)
