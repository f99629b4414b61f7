"""Condenser / coCondenser pre-training (condenser §3.3-3.4; abs-condenser-openqa §3.3) and plain MLM."""
