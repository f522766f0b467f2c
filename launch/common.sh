# Shared by the launch scripts (sourced): the Python to use, a rendezvous port, the pre-emption grace period.
# PY: the Python of the environment mega_depth is installed in (default .venv/bin/python, what tools/setup.sh builds).
# Not PYTHON: that names the interpreter tools/setup.sh builds .venv from, which has none of the packages.
PY=${PY:-.venv/bin/python}
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("mega_depth") is None)' 2>/dev/null; then
  echo "launch: PY=$PY cannot import mega_depth: run bash tools/setup.sh (it builds .venv), or set PY to the Python of an environment that has it installed" >&2
  exit 2
fi
# SIGTERM -> save -> exit: the seconds torchrun waits for its workers before it kills them (its default is 30).
export SAVE_GRACE_S=${SAVE_GRACE_S:-100}  # mega_depth.ds_launcher reads it
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$SAVE_GRACE_S}

# A port every node of a job derives alike, never a fixed one (two jobs on one node would collide): MASTER_PORT
# if set, else one derived from the scheduler's job id, else (one node only) a free port. The last two keep to
# MEGA_DEPTH_PORT_RANGE=LOW-HIGH where it is set (a firewall's open range), and stay below the ephemeral range.
master_port() {
  if [ -n "${MASTER_PORT:-}" ]; then echo "$MASTER_PORT"; return; fi
  local job=${SLURM_JOB_ID:-${PBS_JOBID:-${LSB_JOBID:-${JOB_ID:-}}}}
  if [ -n "$job" ]; then
    "$PY" -m mega_depth.ports --job "$job"
  elif [ "${NNODES:-1}" -gt 1 ]; then
    echo "set MASTER_PORT (the same value on every node) or run under a scheduler that sets a job id" >&2
    return 2
  else
    "$PY" -m mega_depth.ports  # below the ephemeral range: no outgoing connection takes it before torchrun binds
  fi
}
