"""`inference-gateway loadtest`: the SLO tuning kit's load generator and its reports."""
