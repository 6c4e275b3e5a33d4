"""Serving many requests at once: continuous batching with priorities (scheduler), a host-memory
tier for evicted KV pages (host_tier), and traces to replay through them (trace)."""
