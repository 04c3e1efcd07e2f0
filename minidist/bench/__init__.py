"""`minidist bench`: each technique measured, beside the formula in its module's docstring.

collectives.py  allreduce | p2p: the hand-written collectives beside the library's
dp.py, tp.py, pipeline.py, zero.py, sgd.py, batch.py, moe.py, cp.py
                one benchmark per technique (batch: large-batch learning rates, memory)
"""
