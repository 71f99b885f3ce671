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
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   (beside it: the code that the prologs and epilogs share, sourced from this
#   script's folder; without it this epilog logs so at err and exits 0)
#   slurm.conf:  EpilogSlurmctld=/etc/slurm/imexd-epilog-shared.sh
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV):
#   IMEXD_DOMAIN  the shared domain; without it the workload's name must be unique
#   IMEXD         the imexd command (default: imexd on PATH)
#   IMEXD_CONFIG  the control plane's settings file (default /etc/imexd/control.toml)
#   IMEXD_PARTITIONS, IMEXD_MIN_NODES  the prologs' filter: a job that it skips has
#                 nothing to delete, and is left alone here too
#
# Every step is logged through `logger -t imexd-slurm` (syslog), with a copy on stderr:
# the command line, every line imexd printed and its exit status.
#
# Exit status: always 0. A failed delete is logged (syslog tag imexd-slurm, priority
# err) and left to an operator (`imexd workload list`, `imexd workload delete job-<id>`):
# the job is over either way. Until then its channel number stays taken in the domain
# and its device stays on the nodes, owned by the job's user.
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

# The code the slurmctld scripts share (log, the settings, the filter, run_imexd).
common=$(dirname -- "$0")/imexd-slurm-common.sh
if [ ! -r "$common" ]; then
    why="cannot read $common: install it beside this script; nothing deleted"
    logger -t imexd-slurm -p user.err "$why" 2>/dev/null || :
    printf 'imexd-slurm: %s\n' "$why" >&2
    exit 0
fi
# shellcheck source-path=SCRIPTDIR source=imexd-slurm-common.sh
. "$common"

read_settings epilog
need_job epilog
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
workload=job-$SLURM_JOB_ID
skip_unless_imex epilog channel

set -- "$workload"
if [ -n "${IMEXD_DOMAIN:-}" ]; then
    set -- "$@" --domain "$IMEXD_DOMAIN"
fi

log info "$workload: deleting the workload"
status=0
# Returns the moment no node lists the workload (its channel removed), at most 30 s.
run_imexd "workload delete" workload delete "$@" --wait 30 --config "$config" || status=$?
if [ "$status" -ne 0 ]; then
    log err "$workload: imexd workload delete exited $status; run 'imexd workload delete $workload' by hand if it is still listed"
    exit 0
fi
log info "$workload: deleted"
