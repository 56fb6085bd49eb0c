"""Deployment artifacts: the per-rank weight files a compiled plan is shipped with."""
