"""Model analyses (attention entropy, condenser §5)."""
