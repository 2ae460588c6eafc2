"""`magicdec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

`async_engine` runs the LLMEngine on its own thread; `app` is the HTTP API; `metrics` the Prometheus metrics;
`detokenize` streaming text; `chat` chat templates; `protocol` the request bodies.
"""
