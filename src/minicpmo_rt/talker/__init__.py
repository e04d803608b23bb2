"""The Talker (MiniCPMTTS): Thinker text + hidden states -> 25 Hz codec ids."""
