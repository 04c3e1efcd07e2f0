"""Activation checkpointing: keep less of the forward, recompute it in backward (lesson 10).

recompute.py  checkpoint(fn, ...) and CheckpointedSequential, with the predicted peak memory
blocks.py     apply_recompute: every block of a transformer's layers recomputed
"""
