"""Mixed precision (lesson 09).

amp.py       the precision policies, loss scaling and the optimizer over float32 master weights
replicas.py  apply_amp: the main job's stage in mixed precision over its replicas
"""
