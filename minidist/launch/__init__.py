"""Starting a job: the launcher, the rank processes it starts, and the watchdog over them (lessons
01, 03).

launcher.py    `minidist.init()` in each rank, `launch()` and `minidist run` for the parent
processes.py   the OS plumbing: start, stop, job folders, standard input to rank 0
watchdog.py    lifelines, blame for the rank that failed first, the job timeout
"""
