"""The socket side of the gateway: uvicorn run on pre-bound sockets with a graceful drain
(`serving`), and the HTTP protocol that holds clients to their limits (`connections`, with the
limits in `client_limits`, the open connections in `connection_table`, and a response's head sent
with its first body bytes in `head_with_body`)."""
