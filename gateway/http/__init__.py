"""The HTTP edge: routes, request parsing and the ASGI plumbing they share."""
