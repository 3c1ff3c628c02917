"""The coordinator's HTTP port: the live page and the OpenAI-compatible API, one ASGI app
(Starlette) served by uvicorn (see ``app.py``)."""
