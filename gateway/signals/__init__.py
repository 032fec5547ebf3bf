"""What the model servers and the cluster report: scrapers for Triton, vLLM and Kueue metrics."""
