"""Capacity planning: `inference-gateway plan`, from rates or a request trace, over `policies.capacity`."""
