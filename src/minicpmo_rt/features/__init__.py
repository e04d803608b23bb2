"""Causal global AV features from a frozen MiniCPM-o 4.5 Thinker (seed 004).

artifact.py: the saved contract and the default loader; easycom.py: the session reader;
synthetic.py: synthetic sessions in the EasyCom layout; extract.py: the two modes and audits.
"""

from .artifact import (FeatureArtifact, iter_feature_root, load_artifact, save_artifact,  # noqa: F401
                       validate_payload)
