"""minidist: distributed training of neural networks, built by hand one technique at a time.

import minidist
comm = minidist.init()          # however the script was started: see minidist/launch/init.py
"""

__all__ = ["init"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """minidist.init, imported when first asked for: importing minidist alone (as `minidist
    plan` does) imports no comm and no torch."""
    if name == "init":
        from minidist.launch.init import init

        return init
    raise AttributeError(f"module 'minidist' has no attribute {name!r}")
