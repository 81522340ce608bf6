"""The MCP transport: JSON-RPC, both MCP wires, sessions, Origin checks, the caller's scope,
disconnect detection and the WSGI application."""
