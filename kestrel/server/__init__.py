"""OpenAI-compatible HTTP server: FastAPI app, engine process, IPC messages, metrics."""
