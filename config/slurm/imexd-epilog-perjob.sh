#!/bin/sh
# imexd-epilog-perjob.sh: delete the Slurm job's IMEX domain (layout "one domain per job").
#
# The agents stop their IMEX daemons (no job holds imports any more, so this costs
# nothing), remove their files and the job's channel device, CDI spec and env file, and
# go idle until the next assignment. See imexd-prolog-perjob.sh and docs/operations.md.
#
# Install on the slurmctld host (it runs once per job, when the job ends, as SlurmUser):
#   install -m 0755 imexd-epilog-perjob.sh /etc/slurm/imexd-epilog-perjob.sh
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   (beside it: the code that the prologs and epilogs share, sourced from this
#   script's folder; without it this epilog logs so at err and exits 0)
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
domain=job-$SLURM_JOB_ID
skip_unless_imex epilog domain

log info "$domain: deleting the domain"
status=0
# Returns the moment every member has left (its daemon stopped), at most 30 s.
run_imexd "domain delete" domain delete "$domain" --wait 30 --config "$config" || status=$?
if [ "$status" -ne 0 ]; then
    log err "$domain: imexd domain delete exited $status; the domain stays: run 'imexd domain delete $domain' by hand"
    exit 0
fi
log info "$domain: deleted"
