"""Mixed precision (lesson 09).

amp.py  the precision policies, loss scaling and the optimizer over float32 master weights
"""
