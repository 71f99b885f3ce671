#!/bin/sh
# imexd-epilog-shared.sh: delete the Slurm job's workload (layout "shared rack domain,
# one channel per job").
#
# The agents of the job's nodes remove the job's channel device, CDI spec and env file;
# the shared domain and its IMEX daemons keep running. See imexd-prolog-shared.sh and
# docs/operations.md.
#
# Install on the slurmctld host (it runs once per job, when the job ends, as SlurmUser):
#   install -m 0755 imexd-epilog-shared.sh /etc/slurm/imexd-epilog-shared.sh
#   slurm.conf:  EpilogSlurmctld=/etc/slurm/imexd-epilog-shared.sh
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV):
#   IMEXD_DOMAIN  the shared domain; without it the workload's name must be unique
#   IMEXD         the imexd command (default: imexd on PATH)
#   IMEXD_CONFIG  the control plane's settings file (default /etc/imexd/control.toml)
#
# Exit status: always 0. A failed delete is logged (syslog tag imexd-slurm, priority
# err) and left to an operator (`imexd workload list`, `imexd workload delete job-<id>`):
# the job is over either way. Until then its channel number stays taken in the domain
# and its device stays on the nodes, owned by the job's user.
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
workload=job-$SLURM_JOB_ID
set -- "$workload"
if [ -n "${IMEXD_DOMAIN:-}" ]; then
    set -- "$@" --domain "$IMEXD_DOMAIN"
fi

log info "$workload: deleting the workload"
status=0
"$imexd" workload delete "$@" --config "$config" >&2 || status=$?
if [ "$status" -ne 0 ]; then
    log err "$workload: imexd workload delete exited $status; run 'imexd workload delete $workload' by hand if it is still listed"
    exit 0
fi
log info "$workload: deleted"
