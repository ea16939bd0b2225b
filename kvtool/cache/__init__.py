"""KV storage and prefix-cache bookkeeping."""
