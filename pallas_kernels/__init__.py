"""Pallas kernels, each beside its jnp reference. Several read glmjax's cache layout and dsa
helpers, and glmjax's Runtime checks its switches against the kernels' own tuning: glmjax is
imported first, so that importing a kernel module before glmjax does not meet a half-made one."""

import glmjax  # noqa: F401
