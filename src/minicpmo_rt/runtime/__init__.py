"""The runtime: typed stage contracts, the async output snapshot between stages and the
turn-mode pipeline (Thinker -> Talker -> Code2Wav). Import the modules directly
(``contracts``, ``snapshot``, ``turn``); this package re-exports nothing."""
