"""Low-level numerics shared by models and training (below both)."""
