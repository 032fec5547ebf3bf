"""Talking to model servers: backend state, the proxy client and health checks."""
