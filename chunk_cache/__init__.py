"""Content-addressed document KV on storage tiers. Filled in by the blend and tiers issues."""
