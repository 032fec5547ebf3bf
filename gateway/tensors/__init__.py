"""KServe v2 tensors as the gateway handles them: requests merged into batches, answers split back."""
