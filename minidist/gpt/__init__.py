"""The main job: a small GPT trained with every technique of the syllabus composed.

config.py       TrainConfig: the run, and every reason it cannot start
model.py        the plain GPT, built once, full, of minidist/transformer.py's layers
data.py         the shipped text (data/sonnets.txt), as batches
train.py        build_job: each technique's apply_* in order; predicted_nbytes: what they send
context.py      the batch's tokens as the cp ranks hold them; moe.py: what experts refuse
optimizer.py    AdamW with GPT's weight decay, and the loss scale
loop.py         the one training loop (run) and one step of the composed job
reference.py    the single-process run every layout must equal
gather.py       the cut model put back together on rank 0 (for the check and checkpoints)
resume.py       checkpoints: atomic, verified, loadable into any layout
cli.py          `minidist train`: flags and their problems, each rank's run
report.py       memory, bytes per dimension, bubble: the tables and --json; plots.py: pictures
"""
