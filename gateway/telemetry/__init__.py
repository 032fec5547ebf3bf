"""Everything the gateway exports, built in one place against an injected registry."""
