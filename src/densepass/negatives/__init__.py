"""Hard-negative mining."""
