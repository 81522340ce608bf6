"""The shared-memory layer: the segment, its lock, the hash tables in it and the registry that
holds them. Knows nothing of cancellation, MCP or WSGI."""
