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
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   (beside it: the code that the prologs and epilogs share, sourced from this
#   script's folder; without it this prolog logs so at err and exits 2)
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
#   IMEXD_PARTITIONS  the partitions whose jobs get a channel, separated by commas or
#                 spaces (default: empty, every partition); other jobs exit 0 at once
#   IMEXD_MIN_NODES  the fewest nodes a job needs to get a channel (default 2: a
#                 single-node job shares memory over NVLink without IMEX)
#   IMEXD_WAIT    seconds `workload create --wait` waits for every node to report the
#                 channel made (default 60); a node without a live agent never does
#
# Every step is logged through `logger -t imexd-slurm` (syslog; slurmctld itself logs
# only the exit status), with a copy on stderr: the command line, every line imexd
# printed (at priority err when it failed: imexd's own reason, and its table of nodes)
# and its exit status; a failure ends with one line naming the nodes that lack the
# channel and why.
#
# Exit status: 0 when every node of the job made its channel, or when the job needs no
# IMEX (the filter above). Otherwise imexd's status (1 not ready in time or broker
# unreachable, 2 usage, 3 no free channel), after deleting the workload again so that
# a requeued job holds no channel; Slurm then requeues or cancels the job
# (PrologSlurmctld in slurm.conf(5); docs/operations.md says what 22.05 does).
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

# The code the slurmctld scripts share (log, the settings, the filter, run_imexd).
common=$(dirname -- "$0")/imexd-slurm-common.sh
if [ ! -r "$common" ]; then
    why="cannot read $common: install it beside this script; the job does not start"
    logger -t imexd-slurm -p user.err "$why" 2>/dev/null || :
    printf 'imexd-slurm: %s\n' "$why" >&2
    exit 2
fi
# shellcheck source-path=SCRIPTDIR source=imexd-slurm-common.sh
. "$common"

read_settings prolog
need_job prolog
[ -n "${IMEXD_DOMAIN:-}" ] || fail 2 "job $SLURM_JOB_ID: IMEXD_DOMAIN is not set: name the shared domain in $defaults"
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
mode=${IMEXD_CHANNEL_MODE:-0600}
wait=${IMEXD_WAIT:-60}
workload=job-$SLURM_JOB_ID
case $wait in
    '' | *[!0-9]*) fail 2 "IMEXD_WAIT=$wait: expected a whole number of seconds" ;;
esac
skip_unless_imex prolog channel

log info "$workload: creating in domain $IMEXD_DOMAIN on $nodes for uid $SLURM_JOB_UID gid $SLURM_JOB_GID"
status=0
run_imexd "workload create" workload create "$workload" --domain "$IMEXD_DOMAIN" \
    --nodes "$nodes" --uid "$SLURM_JOB_UID" --gid "$SLURM_JOB_GID" --mode "$mode" \
    --wait "$wait" --config "$config" || status=$?
if [ "$status" -ne 0 ]; then
    # The table's rows of the nodes that lack the channel: NODE READY REASON AGE.
    lacking=$(printf '%s\n' "$output" |
        awk '$2 == "no" { printf "%s%s (%s)", sep, $1, $3; sep = ", " }')
    if [ -n "$lacking" ]; then
        log err "$workload: no channel on $lacking after ${wait} s: a node without a running imexd agent never reports one (imexd check, systemctl status imexd there)"
    fi
    log err "$workload: imexd workload create exited $status (its reason is above); deleting the workload, the job does not start"
    run_imexd "workload delete" workload delete "$workload" --domain "$IMEXD_DOMAIN" \
        --wait 30 --config "$config" || :
    exit "$status"
fi
log info "$workload: channel ready on $nodes"
