"""Shared pytest set-up. Fixtures live in tests/fixtures/<topic>.py, one module per topic,
registered here so every test directory sees them."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.trained",
]
