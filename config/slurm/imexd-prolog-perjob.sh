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
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   (beside it: the code that the prologs and epilogs share, sourced from this
#   script's folder; without it this prolog logs so at err and exits 2)
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
config=${IMEXD_CONFIG:-/etc/imexd/control.toml}
mode=${IMEXD_CHANNEL_MODE:-0600}
domain=job-$SLURM_JOB_ID
skip_unless_imex prolog domain

# One command: exit 0 as soon as the domain is UP and every node has made the channel
# device, 1 after 4 minutes; its tables (the domain's, the channel's) go to the log.
set -- --nodes "$nodes" --channel --uid "$SLURM_JOB_UID" --gid "$SLURM_JOB_GID" --mode "$mode"
if [ -n "${IMEXD_SEEN_WITHIN:-}" ]; then
    set -- "$@" --seen-within "$IMEXD_SEEN_WITHIN"
fi
log info "$domain: creating the domain on $nodes, channel 0 for uid $SLURM_JOB_UID gid $SLURM_JOB_GID"
status=0
run_imexd "domain create" domain create "$domain" "$@" --wait 240 --config "$config" || status=$?
if [ "$status" -ne 0 ]; then
    log err "$domain: imexd domain create exited $status (its reason is above); deleting the domain, the job does not start"
    run_imexd "domain delete" domain delete "$domain" --wait 30 --config "$config" || :
    exit "$status"
fi
log info "$domain: domain UP, channel ready on $nodes"
