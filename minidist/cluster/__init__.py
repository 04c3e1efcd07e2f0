"""Beyond one machine: the cluster as data, a simulated cluster and the planner (lesson 13).

hardware.py   GPUs, links and clusters with their sources; the time of a message and of each
              all-reduce algorithm on them
network.py    the network as NCCL drives it: a ring on every card, or a tree, by size
simulate.py   minidist's own code run on a simulated cluster, in simulated time
shapes.py     a model's shape, its parameters and FLOPs, each by a named convention
attention.py  fused attention kernels as measured: their FLOP/s by GPU and sequence length
plan.py       one layout priced: time, memory, bytes per dimension
evidence.py   the efficiencies fitted on published runs, the errors on the others, the band
profiles.py   the frameworks' execution: what data-parallel traffic hides behind compute
search.py     every layout of a cluster, ranked
calibrate.py  this machine measured, as a cluster
custom.py     a cluster from a small JSON or TOML file
cli.py        `minidist plan`: the flags, checked, and the search they ask for
report.py     what `minidist plan` prints: rows, table, band, why, the picture
"""
