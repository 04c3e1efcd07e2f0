"""Which module each lesson's lab cuts, and the tests that grade it (see tools/labs.py)."""

# lesson -> the reference module it cuts, the impl() name that swaps it in, the pytest
# arguments that grade it, and `probe`: a few fast tests that must fail on an unfilled region
LABS = {
    "01": {
        "folder": "lessons/01_processes_p2p",
        "module": "minidist/comm/threads.py",
        "impl": "comm.threads",
        "grade": ["tests/test_comm.py", "-m", "threads"],
        "probe": ["tests/test_comm.py", "-m", "threads", "-k", "p2p_ring"],
    },
    "02": {
        "folder": "lessons/02_collectives",
        "module": "minidist/collectives.py",
        "impl": "collectives",
        "grade": ["tests/test_collectives.py", "-m", "threads"],
        "probe": ["tests/test_collectives.py", "-m", "threads", "-k", "message_counts or right"],
    },
    "03": {
        "folder": "lessons/03_debugging_hangs",
        "module": "minidist/comm/checked.py",
        "impl": "comm.checked",
        "grade": ["tests/test_debug.py", "-m", "threads"],
        "probe": ["tests/test_debug.py", "-m", "threads"],
    },
    "04": {
        "folder": "lessons/04_data_parallel",
        "module": "minidist/data_parallel.py",
        "impl": "data_parallel",
        "grade": ["tests/test_data_parallel.py", "-m", "not processes"],
        "probe": [
            "tests/test_data_parallel.py",
            "-m",
            "not processes",
            "-k",
            "not data_parallel_threads",
        ],
    },
    "05": {
        "folder": "lessons/05_tensor_parallel",
        "module": "minidist/tensor_parallel.py",
        "impl": "tensor_parallel",
        "grade": ["tests/test_tensor_parallel.py", "-m", "threads"],
        "probe": ["tests/test_tensor_parallel.py", "-k", "bytes_per_layer or float32_block"],
    },
    "06": {
        "folder": "lessons/06_pipeline",
        "module": "minidist/schedules.py",
        "impl": "schedules",
        "grade": ["tests/test_schedules.py", "-m", "not processes"],
        "probe": ["tests/test_schedules.py", "-k", "invariants"],
    },
    "07": {
        "folder": "lessons/07_zero",
        "module": "minidist/zero.py",
        "impl": "zero",
        "grade": ["tests/test_zero.py", "-m", "not processes"],
        "probe": ["tests/test_zero.py", "-k", "zero_small_threads"],
    },
    "08": {
        "folder": "lessons/08_sync_async_sgd",
        "module": "minidist/parameter_server.py",
        "impl": "parameter_server",
        "grade": ["tests/test_sgd.py", "-m", "not processes"],
        "probe": ["tests/test_sgd.py", "-k", "pushed_twice or dead_worker_stops"],
    },
    "09": {
        "folder": "lessons/09_mixed_precision",
        "module": "minidist/amp.py",
        "impl": "amp",
        "grade": ["tests/test_amp.py", "-m", "not processes"],
        "probe": ["tests/test_amp.py", "-m", "not processes"],
    },
    "10": {
        "folder": "lessons/10_checkpointing",
        "module": "minidist/checkpointing.py",
        "impl": "checkpointing",
        "grade": ["tests/test_checkpointing.py", "-m", "not processes"],
        "probe": ["tests/test_checkpointing.py", "-m", "not processes", "-k", "not bitwise"],
    },
    "11": {
        "folder": "lessons/11_large_batches",
        "module": "minidist/lr.py",
        "impl": "lr",
        "grade": ["tests/test_lr.py", "-m", "not processes"],
        "probe": ["tests/test_lr.py", "-m", "not processes"],
    },
    "12": {
        "folder": "lessons/12_3d_parallel",
        "module": "minidist/mesh.py",
        "impl": "mesh",
        # and the main job's composition, lab_train.py (tools/labs.py parts)
        "more": [{"module": "minidist/gpt/train.py", "impl": "gpt.train", "lab": "lab_train.py"}],
        "grade": [
            "tests/test_mesh.py",
            "tests/test_train.py::test_train_threads",
            "tests/test_train.py::test_bytes_per_dimension_equal_the_formulas",
        ],
        "probe": [
            "tests/test_mesh.py",
            "tests/test_train.py::test_bytes_per_dimension_equal_the_formulas[options0]",
            "-m",
            "not processes",
        ],
    },
    "13": {
        "folder": "lessons/13_beyond_one_machine",
        "module": "minidist/cluster.py",
        "impl": "cluster",
        "grade": ["tests/test_cluster.py", "tests/test_simulate.py", "-m", "pure or threads"],
        "probe": ["tests/test_cluster.py", "-m", "pure"],
    },
    "14": {
        "folder": "lessons/14_expert_parallel",
        "module": "minidist/expert_parallel.py",
        "impl": "expert_parallel",
        "grade": ["tests/test_expert_parallel.py", "-m", "not processes"],
        "probe": ["tests/test_expert_parallel.py", "-k", "keep_mask or switch_aux or dp_x_ep"],
    },
    "15": {
        "folder": "lessons/15_context_parallel",
        "module": "minidist/context_parallel.py",
        "impl": "context_parallel",
        "grade": ["tests/test_context_parallel.py", "-m", "not processes"],
        "probe": ["tests/test_context_parallel.py", "-k", "bytes_saved_tensors_and_work"],
    },
}
