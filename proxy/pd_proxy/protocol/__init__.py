"""The OpenAI/vLLM wire as pure values: the JSON codec, the endpoints, a client body parsed and
its fields read, the P/D bodies, SSE events and OpenAI-style errors."""
