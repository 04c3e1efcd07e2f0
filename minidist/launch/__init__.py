"""Starting a job: the launcher, the rank processes it starts, and the watchdog over them (lessons
01, 03).

init.py          `minidist.init()` in each rank: how it was started, and its failure hook
launcher.py      `minidist run` and `launch()`, the parent: it starts, watches and stops the ranks
thread_ranks.py  ranks as threads of this process: the one runner of fn(comm) on a ThreadsWorld
processes.py     the OS plumbing: start, stop, job folders, standard input to rank 0
watchdog.py      lifelines, blame for the rank that failed first, the job timeout
pool.py          ranks started once that run one job after another (the test harness's)
"""
