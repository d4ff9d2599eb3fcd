"""The online service (FastAPI app, Redis state store, update engine). Imports ``mpflow.operators`` only."""
