#!/bin/sh
# imexd-taskprolog.sh: put the job's IMEX channel into each task's environment.
#
# Slurm runs the TaskProlog on the compute node, as the job's user, before every task,
# and turns each `export NAME=value` line it prints into the task's environment. This
# one prints the lines of the env file that the node's agent wrote for the job's
# workload job-<id> (both layouts of docs/operations.md name it so):
#   export IMEX_CHANNEL=5
#   export IMEXD_WORKLOAD=job-1234
#   export IMEXD_DOMAIN=rack-07
#   export IMEXD_CLIQUE=<cluster-uuid>.<clique-id>
#   export IMEXD_CHANNEL_DEVICE=/dev/nvidia-caps-imex-channels/channel5
# The file is local (no broker, no credentials, nothing per task beyond one read) and
# exists exactly while the agent has made the channel on this node.
#
# Install on every compute node (the same path on all of them):
#   install -m 0755 imexd-taskprolog.sh /etc/slurm/imexd-taskprolog.sh
#   slurm.conf:  TaskProlog=/etc/slurm/imexd-taskprolog.sh
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV):
#   IMEXD_CHANNELS_ENV_DIR  the agents' [channels] env_dir (default /run/imexd/workloads)
#   IMEXD_TASKPROLOG_BUS    "yes": without an env file, ask the bus with
#                           `imexd workload env` (the job's user then needs read access
#                           to the bus; one broker connection per task)
#   IMEXD, IMEXD_CONFIG, IMEXD_DOMAIN  for that command, as in the prologs
#
# Exit status: always 0. Slurm fails a task whose TaskProlog exits non-zero, and
# TaskProlog is one setting for the whole cluster: a job without a workload (another
# partition, a node without IMEX) gets no lines and runs as usual.
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

log() { # log PRIORITY MESSAGE...: to syslog when logger exists, and to stderr
    priority=$1
    shift
    if command -v logger >/dev/null 2>&1; then
        logger -t imexd-slurm -p "user.$priority" "$*" 2>/dev/null || :
    fi
    printf 'imexd-slurm: %s\n' "$*" >&2 || :
}

# The settings file, sourced with unset variables allowed; parsed and tried in a
# subshell first, so that a broken file is reported instead of ending this script half
# way (as in imexd-slurm-common.sh: the status of its last command does not count).
defaults=${IMEXD_SLURM_ENV:-/etc/imexd/slurm.env}
if [ -r "$defaults" ]; then
    # shellcheck source=/dev/null
    if sh -n "$defaults" 2>/dev/null && (set +eu && . "$defaults"; exit 0) >/dev/null 2>&1
    then
        set -a +eu
        # shellcheck source=/dev/null
        . "$defaults"
        set +a -eu
    else
        log err "cannot read the settings in $defaults: run it with sh to see why; going on without"
    fi
fi

[ -n "${SLURM_JOB_ID:-}" ] || exit 0
workload=job-$SLURM_JOB_ID
file=${IMEXD_CHANNELS_ENV_DIR:-/run/imexd/workloads}/$workload.env

if [ -r "$file" ]; then
    # KEY=value lines, as the agent writes them; anything else is skipped.
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in
            [A-Za-z_]*=*) printf 'export %s\n' "$line" ;;
        esac
    done <"$file" || log warning "$workload: cannot read $file"
    exit 0
fi

if [ "${IMEXD_TASKPROLOG_BUS:-}" = yes ]; then
    set -- "$workload"
    if [ -n "${IMEXD_DOMAIN:-}" ]; then
        set -- "$@" --domain "$IMEXD_DOMAIN"
    fi
    status=0
    lines=$("${IMEXD:-imexd}" workload env "$@" --config "${IMEXD_CONFIG:-/etc/imexd/control.toml}") ||
        status=$?
    if [ "$status" -eq 0 ]; then
        printf '%s\n' "$lines" | grep '^export [A-Za-z_][A-Za-z0-9_]*=' || :
    else
        log info "$workload: imexd workload env exited $status: no IMEX channel for this task"
    fi
fi
exit 0
