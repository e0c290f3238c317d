"""The HTTP layer (FastAPI). Imports no torch: recipes and headers are checked through
``maec_core``'s torch-free modules."""
