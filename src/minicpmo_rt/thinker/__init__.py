"""The Thinker: MiniCPM-o 4.5's Qwen3 LLM with its SigLIP vision encoder, resampler,
Whisper audio encoder and audio projection, plus the processors and prompt layouts
that feed it and the turn-mode generation loop that reads it out.

Modules are named for what they hold (``llm``, ``vision``, ``resampler``,
``image_processor``, ``prompt``, ``generate``, ``audio``, ``mel``, ``model``,
``session``); import them directly, this package re-exports nothing.
"""
