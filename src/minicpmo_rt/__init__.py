"""minicpmo-rt: a streaming runtime for MiniCPM-o 4.5."""

__version__ = "0.1.0"
