"""vLLM as a rollmesh engine backend: its config and the LLMProxy's client of its server."""
