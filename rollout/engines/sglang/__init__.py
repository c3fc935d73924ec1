"""SGLang as a rollmesh engine backend: its config and the client of its (and the embedded engine's) HTTP API."""
