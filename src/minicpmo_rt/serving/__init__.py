"""An HTTP server for spoken conversation: OpenAI-style chat completions (turn mode) or duplex sessions.

    openai_api  chat-completions request parsing and response bodies (plain data; no model, no sockets)
    turns       TurnService: one worker thread that owns a TurnPipeline and batches requests
    duplex      DuplexService: duplex sessions on the seats of one DuplexBatch, stepped together
    voices      --voice parsing and the services' start-up check of the recordings
    websocket   the server side of RFC 6455, for the realtime duplex route
    http        the stdlib HTTP server that routes requests to the service of its mode

Standard library only (``http.server``), so serving adds no dependency to the package.
"""
