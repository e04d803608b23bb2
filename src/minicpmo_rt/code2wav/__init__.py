"""Code2Wav: speech codes (25 Hz, 6561-entry codebook) -> 24 kHz waveform.

flow_config (flow.yaml), encoder / dit / cfm / flow (the flow: codes -> 80-bin mel at
50 Hz, plain PyTorch reference path), HiFT vocoders, the voice-prompt frontend and the
pipeline. Nothing is imported here: import the submodule you need (keeps start-up lazy).
"""
