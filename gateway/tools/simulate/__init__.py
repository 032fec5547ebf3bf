"""`inference-gateway simulate`: a discrete-event simulator of the gateway's queues that drives its own
policies (dispatch, fairness, admission) with Poisson or replayed arrivals, validated against
queueing theory (tests/unit/test_simulate_theory.py)."""
