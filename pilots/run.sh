#!/bin/bash
export PYTHONPATH=/work/wt11/python:/work/wt11 OMP_NUM_THREADS=1
exec nice -n 15 /work/main/.venv/bin/python /tmp/mp/pilot.py "$@"
