"""The cancellation layer: request ids, reasons, eviction order, the storage interface and its
shared-memory implementation, the policy and the janitor. Scopes arrive as strings."""
