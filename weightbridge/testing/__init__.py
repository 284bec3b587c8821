"""Test tools for groups built on the adapters: `weightbridge.testing.fuzz`, a protocol fuzz
of updates, deltas, joins, leaves, kills and stalls in one process (every sync mode)."""
