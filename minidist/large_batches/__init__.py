"""Large batches (lesson 11).

lr.py            learning-rate scaling rules and warm-up, as one schedule
accumulation.py  gradient accumulation over microbatches
bench.py         `minidist bench batch`: large batches, and what mixed precision and
                 checkpointing save (lessons 09-11)
"""
