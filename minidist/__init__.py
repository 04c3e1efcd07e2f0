"""minidist: distributed training of neural networks, built by hand one technique at a time.

import minidist
comm = minidist.init()          # however the script was started: see minidist/launch/init.py
"""

from minidist.launch.init import init

__all__ = ["init"]
__version__ = "0.1.0"
