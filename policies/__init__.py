"""Pure decision logic for the inference gateway.

Rules every module here keeps:
- Standard library only: no asyncio, anyio, time, random, redis, starlette, prometheus_client.
- Snapshots and `now` go in, frozen decision values come out; nothing here reads a clock,
  draws a random number or touches a socket. The caller (``gateway/``) feeds it events and time.
- Each module answers one question, stated in its first docstring line.
"""
