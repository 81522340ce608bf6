"""What the tests share besides fixtures (those are in tests/conftest.py): registry names,
the gunicorn harness, fork helpers, the fake clock, a background runner, the MCP and WSGI
clients, the table rig, the tools under test."""
