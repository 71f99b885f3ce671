#!/bin/sh
# imexd-prolog-shared.sh: give a Slurm job its own IMEX channel in a shared domain.
#
# Layout "shared rack domain, one channel per job" (docs/operations.md): the nodes'
# agents stay in one long-lived domain and their IMEX daemons keep running across jobs.
# This prolog creates the workload job-<id> in that domain on the job's nodes, owned by
# the job's user and group, and waits until every node has made its channel device
# (docs/channels.md). Nothing restarts.
#
# Install on the slurmctld host (it runs once per job, at allocation, as SlurmUser, who
# must be able to read the control plane's broker credentials):
#   install -m 0755 imexd-prolog-shared.sh /etc/slurm/imexd-prolog-shared.sh
#   slurm.conf:
#     PrologSlurmctld=/etc/slurm/imexd-prolog-shared.sh
#     EpilogSlurmctld=/etc/slurm/imexd-epilog-shared.sh
#     TaskProlog=/etc/slurm/imexd-taskprolog.sh        (the script on every node)
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV), a shell
# file of KEY=value lines read after the environment (slurmctld gives its scripts no
# environment of their own, so the file is where they are set):
#   IMEXD_DOMAIN  the shared domain (required), e.g. rack-07
#   IMEXD         the imexd command (default: imexd on PATH)
#   IMEXD_CONFIG  the control plane's settings file (default /etc/imexd/control.toml)
#   IMEXD_CHANNEL_MODE  the channel device's permission bits (default 0600: the job's
#                 user only; 0660 also admits every member of the job's group)
#
# Exit status: 0 when every node of the job made its channel. Otherwise imexd's status
# (1 not ready in time or broker unreachable, 2 usage, 3 no free channel), after
# deleting the workload again so that a requeued job holds no channel; Slurm then
# requeues or cancels the job (PrologSlurmctld in slurm.conf(5)).
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

log() { # log PRIORITY MESSAGE...: to syslog when logger exists, and to stderr
    priority=$1
    shift
    if command -v logger >/dev/null 2>&1; then
        logger -t imexd-slurm -p "user.$priority" "$*" 2>/dev/null || :
    fi
    printf 'imexd-slurm: %s\n' "$*" >&2
}

fail() { # fail STATUS MESSAGE...
    status=$1
    shift
    log err "$*"
    exit "$status"
}

# The settings file, sourced with unset variables allowed; tried in a subshell first, so
# that a broken file is reported instead of ending this script half way.
defaults=${IMEXD_SLURM_ENV:-/etc/imexd/slurm.env}
if [ -r "$defaults" ]; then
    # shellcheck source=/dev/null
    if (set +u && . "$defaults") >/dev/null 2>&1; then
        set -a +u
        # shellcheck source=/dev/null
        . "$defaults"
        set +a -u
    else
        fail 2 "cannot read the settings in $defaults: run it with sh to see why"
    fi
fi

[ -n "${SLURM_JOB_ID:-}" ] || fail 2 "SLURM_JOB_ID is not set: run this as PrologSlurmctld"
[ -n "${SLURM_JOB_NODELIST:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_NODELIST is not set"
[ -n "${SLURM_JOB_UID:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_UID is not set"
[ -n "${SLURM_JOB_GID:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_GID is not set"
[ -n "${IMEXD_DOMAIN:-}" ] || fail 2 "job $SLURM_JOB_ID: IMEXD_DOMAIN is not set: name the shared domain in $defaults"
imexd=${IMEXD:-imexd}
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
mode=${IMEXD_CHANNEL_MODE:-0600}
workload=job-$SLURM_JOB_ID

# Slurm's node names, one per line, as imexd's lowercase comma-separated list.
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") ||
    fail 1 "job $SLURM_JOB_ID: scontrol show hostnames $SLURM_JOB_NODELIST failed"
nodes=$(printf '%s\n' "$hosts" | tr '[:upper:]' '[:lower:]' | tr -s '\n' ',')
nodes=${nodes#,}
nodes=${nodes%,}
[ -n "$nodes" ] || fail 1 "job $SLURM_JOB_ID: no nodes in $SLURM_JOB_NODELIST"

log info "$workload: creating in domain $IMEXD_DOMAIN on $nodes for uid $SLURM_JOB_UID gid $SLURM_JOB_GID"
status=0
"$imexd" workload create "$workload" --domain "$IMEXD_DOMAIN" --nodes "$nodes" \
    --uid "$SLURM_JOB_UID" --gid "$SLURM_JOB_GID" --mode "$mode" --wait 60 \
    --config "$config" >&2 || status=$?
if [ "$status" -ne 0 ]; then
    log err "$workload: imexd workload create exited $status; deleting the workload"
    "$imexd" workload delete "$workload" --domain "$IMEXD_DOMAIN" --config "$config" >&2 || :
    exit "$status"
fi
log info "$workload: channel ready on $nodes"
