# minidist: every target creates the virtual environment first if it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch: the CPU build. On machines whose pip finds a local CPU wheel this pin takes it; elsewhere
# override, e.g. make test TORCH='torch --index-url <your CPU wheel index>'.
TORCH  ?= torch==2.13.0
L      ?= 02
DIR    ?= ../minidist-course

.PHONY: test test-fast demo bench gpu-check lab labs handout lint venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# two pytest workers: the thread tier is Python under one interpreter lock, so one worker leaves
# a core idle while it runs (the whole suite: 712 s in one worker, 505 s in two, on 2 cores)
JOBS   ?= 2

test: venv
	$(PY) -m pytest -q -n $(JOBS)

test-fast: venv
	$(PY) -m pytest -q -n $(JOBS) -m "not processes"

demo: venv
	$(VENV)/bin/minidist train --dp 2 --pp 2 --tp 2 --microbatches 4 --backend mpi --check

# every benchmark, side by side with its formula; one run on a shared machine: read the ratios
bench: venv
	$(VENV)/bin/minidist bench allreduce -n 2 --backend mpi
	$(VENV)/bin/minidist bench p2p -n 2 --backend mpi
	$(VENV)/bin/minidist bench dp -n 2 --backend mpi
	$(VENV)/bin/minidist bench tp -n 2 --backend mpi
	$(VENV)/bin/minidist bench pipeline -n 2 --backend mpi
	$(VENV)/bin/minidist bench zero -n 2 4 --backend mpi
	$(VENV)/bin/minidist bench sgd -n 4 --backend mpi
	$(VENV)/bin/minidist bench batch
	$(VENV)/bin/minidist bench moe -n 4 --backend mpi
	$(VENV)/bin/minidist bench cp -n 4 --backend mpi

# where a GPU is lent: the gpu tests, nccl all-reduce busbw, a tp block's bf16 TFLOP/s and the
# main job on nccl with --check, under 8 minutes, one summary; without a GPU one line, exit 0
gpu-check: venv
	$(PY) tools/gpu_check.py

# grade a learner's lab: a table of its tasks and points, from the lesson's tests run against
# lessons/$(L)_*/lab.py; GRADE="--json out/$(L).json --junit out/$(L).xml" for an autograder
lab: venv
	$(PY) tools/labs.py grade $(L) $(GRADE)

# regenerate every lab.py from the reference modules; a lab holding work needs FORCE=1
labs: venv
	$(PY) tools/labs.py generate $(if $(FORCE),--force)

# the student's copy of the course, with no reference solution in it (instructor/grading.md)
handout: venv
	$(PY) tools/labs.py export $(DIR)

lint: venv
	$(VENV)/bin/ruff format --check minidist tests tools lessons
	$(VENV)/bin/ruff check minidist tests tools lessons

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
