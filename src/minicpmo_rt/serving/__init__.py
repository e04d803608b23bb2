"""An HTTP server for spoken turns: OpenAI-style chat completions answered in text and speech.

    openai_api  request parsing and response bodies (plain data; no model, no sockets)
    turns       TurnService: one worker thread that owns a TurnPipeline and batches requests
    http        the stdlib HTTP server that routes requests to the service

Standard library only (``http.server``), so serving adds no dependency to the package.
"""
