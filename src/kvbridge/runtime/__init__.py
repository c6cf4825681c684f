"""Runtime: handshake, per-request reads, notifications, leases and timeouts (all side effects live here)."""
