#!/bin/sh
# imexd-prolog-perjob.sh: give a Slurm job its own IMEX domain and channel.
#
# Layout "one domain per job" (docs/operations.md): the job's nodes (allocated
# exclusively: one IMEX daemon per node) form the domain job-<id>, which has one workload
# of the same name on channel 0, owned by the job's user and group. The prolog waits
# until the domain is UP and every node has made the channel device (docs/channels.md).
# The agents run with `[domain] assigned = true`.
#
# Install on the slurmctld host (it runs once per job, at allocation, as SlurmUser, who
# must be able to read the control plane's broker credentials):
#   install -m 0755 imexd-prolog-perjob.sh /etc/slurm/imexd-prolog-perjob.sh
#   slurm.conf:
#     PrologSlurmctld=/etc/slurm/imexd-prolog-perjob.sh
#     EpilogSlurmctld=/etc/slurm/imexd-epilog-perjob.sh
#     TaskProlog=/etc/slurm/imexd-taskprolog.sh        (the script on every node)
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV), a shell
# file of KEY=value lines read after the environment (slurmctld gives its scripts no
# environment of their own, so the file is where they are set):
#   IMEXD         the imexd command (default: imexd on PATH)
#   IMEXD_CONFIG  the control plane's settings file (default /etc/imexd/control.toml)
#   IMEXD_CHANNEL_MODE  the channel device's permission bits (default 0600: the job's
#                 user only; 0660 also admits every member of the job's group)
#   IMEXD_PARTITIONS  the partitions whose jobs get a domain, separated by commas or
#                 spaces (default: empty, every partition); other jobs exit 0 at once
#   IMEXD_MIN_NODES  the fewest nodes a job needs to get a domain (default 2: a
#                 single-node job shares memory over NVLink without IMEX)
#   IMEXD_SEEN_WITHIN  passed as `domain create --seen-within`: how recently an agent
#                 must have reported each node (default: imexd's own)
#
# Nodes must be allocated exclusively (`--exclusive`, or OverSubscribe=EXCLUSIVE on the
# partition): a node runs one IMEX daemon, so it can be in one job's domain at a time.
#
# Every step is logged through `logger -t imexd-slurm` (syslog; slurmctld itself logs
# only the exit status), with a copy on stderr: the command line, every line imexd
# printed (at priority err when it failed: imexd's own reason) and its exit status.
#
# Exit status: 0 when the domain is UP and every node made the channel, or when the job
# needs no IMEX (the filter above). Otherwise imexd's status (1 not ready in time or
# broker unreachable, 2 usage, for example a node still in another job's domain or a
# node that no agent reported lately), after deleting the domain again so that its
# nodes are free for the next job; Slurm then requeues or cancels the job
# (PrologSlurmctld in slurm.conf(5); docs/operations.md says what 22.05 does).
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
imexd=${IMEXD:-imexd}
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
mode=${IMEXD_CHANNEL_MODE:-0600}
domain=job-$SLURM_JOB_ID
min_nodes=${IMEXD_MIN_NODES:-2}
case $min_nodes in
    '' | *[!0-9]*) fail 2 "IMEXD_MIN_NODES=$min_nodes: expected a whole number of nodes" ;;
esac

# The filter: a job on a partition that IMEXD_PARTITIONS does not list needs no IMEX.
if [ -n "${IMEXD_PARTITIONS:-}" ]; then
    listed=no
    set -f
    for partition in $(printf '%s\n' "$IMEXD_PARTITIONS" | tr ',' ' '); do
        [ "$partition" != "${SLURM_JOB_PARTITION:-}" ] || listed=yes
    done
    set +f
    if [ "$listed" = no ]; then
        log info "job $SLURM_JOB_ID: partition ${SLURM_JOB_PARTITION:-(none)} is not in IMEXD_PARTITIONS ($IMEXD_PARTITIONS): no IMEX domain, nothing to do"
        exit 0
    fi
fi

# Slurm's node names, one per line, as imexd's lowercase comma-separated list.
if ! hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST"); then
    why=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1 >/dev/null) || :
    fail 1 "job $SLURM_JOB_ID: scontrol show hostnames $SLURM_JOB_NODELIST failed: ${why:-no message}"
fi
nodes=$(printf '%s\n' "$hosts" | tr '[:upper:]' '[:lower:]' | tr -s '\n' ',')
nodes=${nodes#,}
nodes=${nodes%,}
[ -n "$nodes" ] || fail 1 "job $SLURM_JOB_ID: no nodes in $SLURM_JOB_NODELIST"

# The filter: a job on fewer than IMEXD_MIN_NODES nodes needs no IMEX.
count=$(printf '%s\n' "$hosts" | grep -c .) || :
if [ "$count" -lt "$min_nodes" ]; then
    log info "job $SLURM_JOB_ID: $count node(s) ($nodes), fewer than IMEXD_MIN_NODES=$min_nodes: no IMEX domain, nothing to do"
    exit 0
fi

# run_imexd STEP ARGS...: run imexd with ARGS, logging the command line, every line it
# prints (at err when it fails: imexd's own reason) and its exit status, which it
# returns.
run_imexd() {
    step=$1
    shift
    log info "$domain: running $imexd $*"
    result=0
    # Unbuffered: imexd's lines (stdout and stderr) in the order it printed them.
    output=$(PYTHONUNBUFFERED=1 "$imexd" "$@" 2>&1) || result=$?
    level=info
    [ "$result" -eq 0 ] || level=err
    printf '%s\n' "$output" | while IFS= read -r line; do
        [ -z "$line" ] || log "$level" "$domain: $step: $line"
    done
    log "$level" "$domain: imexd $step exited $result"
    return "$result"
}

set -- --nodes "$nodes" --channel --uid "$SLURM_JOB_UID" --gid "$SLURM_JOB_GID" --mode "$mode"
if [ -n "${IMEXD_SEEN_WITHIN:-}" ]; then
    set -- "$@" --seen-within "$IMEXD_SEEN_WITHIN"
fi
log info "$domain: creating the domain on $nodes, channel 0 for uid $SLURM_JOB_UID gid $SLURM_JOB_GID"
status=0
run_imexd "domain create" domain create "$domain" "$@" --config "$config" || status=$?
step="domain create"
if [ "$status" -eq 0 ]; then
    # Exit 0 as soon as the domain is UP, 1 after 4 minutes; its table goes to the log.
    step="domain status"
    run_imexd "$step" domain status "$domain" --wait 240 --config "$config" || status=$?
fi
if [ "$status" -eq 0 ]; then
    # The channel device on every node, made as the agents join (usually already there).
    step="workload status"
    run_imexd "$step" workload status "$domain" --domain "$domain" --wait 60 \
        --config "$config" || status=$?
fi
if [ "$status" -ne 0 ]; then
    log err "$domain: imexd $step exited $status (its reason is above); deleting the domain, the job does not start"
    run_imexd "domain delete" domain delete "$domain" --config "$config" || :
    exit "$status"
fi
log info "$domain: domain UP, channel ready on $nodes"
