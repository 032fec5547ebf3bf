"""The tools beside the gateway, each behind a command of `inference-gateway`: the simulated model
server (`sim`, model_server/), the gateway's twin on simulated time (`simulate`, simulate/), and
capacity planning (`plan`, planning/). None is on a request's path."""
