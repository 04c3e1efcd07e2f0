"""The main job: a small GPT trained with every technique of the syllabus composed.

model.py      the GPT, full and cut for dp x pp x tp
data.py       the shipped text (data/sonnets.txt), as batches
train.py      the techniques composed around the model, in a fixed order; one training step
replicas.py   step 3: data parallel, mixed precision or ZeRO behind one interface
reference.py  the single-process run every layout must equal
gather.py     the cut model put back together on rank 0 (for the check and checkpoints)
resume.py     checkpoints: atomic, verified, loadable into any layout
cli.py        `minidist train`: progress, memory, bytes per dimension, bubble, --check
"""
