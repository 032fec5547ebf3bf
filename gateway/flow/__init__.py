"""The request's way through the gateway: admission, the wait for a slot, and its release."""
