"""Prefill/decode engine: jitted device steps over the paged cache, host-side sessions."""
