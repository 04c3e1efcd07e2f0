"""The main job: a small GPT trained with every technique of the syllabus composed.

config.py       TrainConfig: the run, and every reason it cannot start
model.py        the plain GPT, built once, full; GPT.cut records each cut
data.py         the shipped text (data/sonnets.txt), as batches
train.py        build_job: the techniques applied in order; predicted_nbytes: what they send
parallelize.py  the steps that cut the model: tensor, recompute, pipeline
context.py      context parallelism on the GPT (apply_cp); moe.py: experts (apply_ep)
replicas.py     data parallelism or ZeRO, in the run's precision, behind one interface
optimizer.py    AdamW with GPT's weight decay, and the loss scale
loop.py         the one training loop (run) and one step of the composed job
reference.py    the single-process run every layout must equal
gather.py       the cut model put back together on rank 0 (for the check and checkpoints)
resume.py       checkpoints: atomic, verified, loadable into any layout
cli.py          `minidist train`: flags and their problems, each rank's run
report.py       memory, bytes per dimension, bubble: the tables and --json; plots.py: pictures
"""
