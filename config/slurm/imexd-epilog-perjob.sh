#!/bin/sh
# imexd-epilog-perjob.sh: delete the Slurm job's IMEX domain (layout "one domain per job").
#
# The agents stop their IMEX daemons (no job holds imports any more, so this costs
# nothing), remove their files and the job's channel device, CDI spec and env file, and
# go idle until the next assignment. See imexd-prolog-perjob.sh and docs/operations.md.
#
# Install on the slurmctld host (it runs once per job, when the job ends, as SlurmUser):
#   install -m 0755 imexd-epilog-perjob.sh /etc/slurm/imexd-epilog-perjob.sh
#   slurm.conf:  EpilogSlurmctld=/etc/slurm/imexd-epilog-perjob.sh
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV):
#   IMEXD         the imexd command (default: imexd on PATH)
#   IMEXD_CONFIG  the control plane's settings file (default /etc/imexd/control.toml)
#   IMEXD_PARTITIONS, IMEXD_MIN_NODES  the prologs' filter: a job that it skips has
#                 nothing to delete, and is left alone here too
#
# Every step is logged through `logger -t imexd-slurm` (syslog), with a copy on stderr:
# the command line, every line imexd printed and its exit status.
#
# Exit status: always 0. A failed delete is logged (syslog tag imexd-slurm, priority
# err) and left to an operator (`imexd domain list`, `imexd domain delete job-<id>`):
# the job is over either way, and a non-zero exit would not bring the domain back.
# While the domain stays, its nodes are refused to the next job's prolog (exit 2,
# "node ... is in another domain"), which fails that job instead of taking the nodes
# from a domain whose daemons may still run.
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
        log err "cannot read the settings in $defaults: run it with sh to see why; going on without"
    fi
fi

if [ -z "${SLURM_JOB_ID:-}" ]; then
    log err "SLURM_JOB_ID is not set: run this as EpilogSlurmctld; nothing deleted"
    exit 0
fi
imexd=${IMEXD:-imexd}
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
domain=job-$SLURM_JOB_ID

# The prolog's filter (IMEXD_PARTITIONS, IMEXD_MIN_NODES): a job that it skipped has no
# IMEX domain to delete. When the filter cannot be judged, delete anyway (a miss is harmless).
min_nodes=${IMEXD_MIN_NODES:-2}
case $min_nodes in
    '' | *[!0-9]*)
        log err "IMEXD_MIN_NODES=$min_nodes: expected a whole number of nodes; deleting regardless"
        min_nodes=0
        ;;
esac
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
if [ "$min_nodes" -gt 0 ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    if hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST"); then
        count=$(printf '%s\n' "$hosts" | grep -c .) || :
        if [ "$count" -lt "$min_nodes" ]; then
            log info "job $SLURM_JOB_ID: $count node(s), fewer than IMEXD_MIN_NODES=$min_nodes: no IMEX domain, nothing to do"
            exit 0
        fi
    else
        why=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1 >/dev/null) || :
        log err "job $SLURM_JOB_ID: scontrol show hostnames $SLURM_JOB_NODELIST failed: ${why:-no message}; deleting regardless"
    fi
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

log info "$domain: deleting the domain"
status=0
run_imexd "domain delete" domain delete "$domain" --config "$config" || status=$?
if [ "$status" -ne 0 ]; then
    log err "$domain: imexd domain delete exited $status; the domain stays: run 'imexd domain delete $domain' by hand"
    exit 0
fi
log info "$domain: deleted"
