"""A cluster from a small file: your GPUs, nodes and network, for `minidist plan --cluster FILE`.

Equals: nothing runs here; the file's numbers become a hardware.Cluster, the presets' way.
The file (JSON, or TOML: .toml) names a preset to start from (`base`, default none: then every
field is needed) and what differs, in the units spec sheets use:

    base = "dgx-h100"                 # a preset of hardware.PRESETS, or leave out
    name = "my cluster"
    gpus_per_node = 8
    nics = 8                          # network cards a node (one a GPU: rail-optimized)
    oversubscription = 1.0            # the fabric's taper when every node sends at once
    node_watts = 10200
    usd_per_gpu_hour = 4.0
    pue = 1.2
    [gpu]
    name = "H100-SXM5-80GB"
    peak_tflops = 989                 # dense bf16
    fp8_tflops = 1979                 # dense FP8; 0: none
    memory_gb = 80
    memory_bw_gb_s = 3350
    watts = 700
    sms = 132
    calibration = "H100"              # whose fitted efficiencies (plan.CALIBRATED) it takes
    [intra]                           # between two GPUs of a node
    name = "NVLink 4"
    latency_us = 0.47
    bandwidth_gb_s = 450              # one direction, per GPU
    [inter]                           # from a GPU to another node, its share of the cards
    name = "NDR"
    latency_us = 2.7
    bandwidth_gb_s = 50

Every number must be positive and finite (fp8_tflops may be 0); an unknown key, a missing one
or a bad value is refused naming the key (ValueError, one line each).
Ladder: the file -> load (checked) -> a hardware.Cluster plan.step prices like any preset.
Lesson: lessons/13_beyond_one_machine/.   Run: minidist plan --cluster my_cluster.toml ...
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import tomllib

from minidist.cluster import hardware
from minidist.cluster.hardware import GB, GPU, Cluster, Link

# key -> (the dataclass field, the factor from the file's unit to the field's)
GPU_KEYS = {
    "name": ("name", None),
    "peak_tflops": ("peak_flops", 1e12),
    "fp8_tflops": ("fp8_flops", 1e12),
    "memory_gb": ("memory", GB),
    "memory_bw_gb_s": ("memory_bw", GB),
    "watts": ("watts", 1.0),
    "sms": ("sms", 1),
    "calibration": ("calibration", None),
}
LINK_KEYS = {
    "name": ("name", None),
    "latency_us": ("latency", 1e-6),
    "bandwidth_gb_s": ("bandwidth", GB),
}
CLUSTER_KEYS = {
    "name": ("name", None),
    "gpus_per_node": ("gpus_per_node", 1),
    "nics": ("nics", 1),
    "oversubscription": ("oversubscription", 1.0),
    "node_watts": ("node_watts", 1.0),
    "usd_per_gpu_hour": ("usd_per_gpu_hour", 1.0),
    "pue": ("pue", 1.0),
}
MAY_BE_ZERO = {"fp8_tflops", "usd_per_gpu_hour"}
CALIBRATIONS = ("A100", "H100")


def load(path: str) -> Cluster:
    """The cluster the file at path describes (the module docstring's format); ValueError
    naming every bad key."""
    with open(path, "rb") as f:
        text = f.read()
    try:
        data = tomllib.loads(text.decode()) if path.endswith(".toml") else json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not {'TOML' if path.endswith('.toml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the file must hold one table of keys")
    found = []
    base = data.pop("base", None)
    if base is not None and base not in hardware.PRESETS:
        found.append(f"base={base!r}: known presets are {', '.join(hardware.PRESETS)}")
        base = None
    start = hardware.PRESETS[base] if base else None
    parts = {k: data.pop(k, {}) for k in ("gpu", "intra", "inter")}
    fields = _read(data, CLUSTER_KEYS, "", found)
    gpu = _read(parts["gpu"], GPU_KEYS, "gpu.", found)
    links = {k: _read(parts[k], LINK_KEYS, f"{k}.", found) for k in ("intra", "inter")}
    if found:
        raise ValueError("; ".join(found))
    if start is None:
        found += _missing(fields, CLUSTER_KEYS, "", {"nics", "oversubscription"})
        found += _missing(gpu, GPU_KEYS, "gpu.", {"fp8_flops", "sms", "calibration"})
        for k in ("intra", "inter"):
            found += _missing(links[k], LINK_KEYS, f"{k}.", set())
        if found:
            raise ValueError("; ".join(found) + " (or name a base preset)")
        return Cluster(
            gpu=GPU(**gpu), intra=Link(**links["intra"]), inter=Link(**links["inter"]), **fields
        )
    return replace(
        start,
        gpu=replace(start.gpu, **gpu),
        intra=replace(start.intra, **links["intra"]),
        inter=replace(start.inter, **links["inter"]),
        **fields,
    )


def _read(table, keys: dict, where: str, found: list) -> dict:
    """The dataclass fields of one table, converted to the field's units; its problems appended
    to found, one a key."""
    if not isinstance(table, dict):
        found.append(f"{where.rstrip('.') or 'the file'}: must be a table of keys")
        return {}
    fields = {}
    for key, value in table.items():
        if key not in keys:
            found.append(f"{where}{key}: unknown; known: {', '.join(keys)}")
            continue
        field, factor = keys[key]
        if factor is None:
            if not isinstance(value, str) or not value:
                found.append(f"{where}{key}={value!r}: must be a name")
            elif key == "calibration" and value not in CALIBRATIONS:
                found.append(f"{where}{key}={value!r}: one of {', '.join(CALIBRATIONS)}")
            else:
                fields[field] = value
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        zero = key in MAY_BE_ZERO
        if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            found.append(f"{where}{key}={value!r}: must be a {'' if zero else 'positive '}number")
        elif isinstance(factor, int) and (not float(value).is_integer()):
            found.append(f"{where}{key}={value!r}: must be a whole number")
        else:
            fields[field] = int(value) if isinstance(factor, int) else value * factor
    return fields


def _missing(fields: dict, keys: dict, where: str, optional: set) -> list[str]:
    """One line for each key a file without a base preset must give."""
    return [
        f"{where}{key}: missing"
        for key, (field, _) in keys.items()
        if field not in fields and field not in optional
    ]
