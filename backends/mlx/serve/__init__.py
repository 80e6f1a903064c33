"""The OpenAI-compatible server: app.py (routes, the worker), requests.py (request fields -> generate())."""
