"""pytest's configuration: the fixtures every test file shares (the tiny offline model, a file of short problems)."""

pytest_plugins = ["tests.common"]
