"""The programs: the gateway assembled (`app`: its parts built once by `runtime`, the routes wired)
and the command line that runs it and its tools (`cli`, with `probe` for a container's health
check and `arguments` for the numbers it reads)."""
