"""Turn heads on 5 Hz feature artifacts.

labels.py: 5 Hz targets from EasyCom transcripts; data.py: artifacts + targets -> session
sequences and splits; models.py: linear probe, causal TCN and GRU; train.py: training,
baselines and evaluation; metrics.py: numpy metrics; plots.py: ROC/PR curves and timelines.
"""
