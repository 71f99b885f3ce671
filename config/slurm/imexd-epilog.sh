#!/bin/sh
# imexd-epilog.sh: the epilog of a cluster with both layouts, picking one per partition.
#
# Runs imexd-epilog-perjob.sh (`domain delete job-<id>`) for a job on a partition of
# IMEXD_LAYOUT_PERJOB, and imexd-epilog-shared.sh (`workload delete job-<id>` in the
# partition's domain) for a job on a partition of IMEXD_LAYOUT_SHARED, picking as
# imexd-prolog.sh does (see its header and docs/operations.md).
#
# Install on the slurmctld host (it runs once per job, when the job ends, as SlurmUser),
# beside both layouts' scripts and the code they share (without them it logs so at err
# and exits 0):
#   install -m 0755 imexd-prolog*.sh imexd-epilog*.sh /etc/slurm/
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   slurm.conf:  EpilogSlurmctld=/etc/slurm/imexd-epilog.sh
#
# Settings: IMEXD_LAYOUT_PERJOB and IMEXD_LAYOUT_SHARED as for imexd-prolog.sh, read
# again when the job ends. The epilog deletes what the prolog made as long as the job's
# partition stays in the same list, with the same domain: the rest of the file, the
# order of the lists, other partitions, IMEXD_DOMAIN and IMEXD_PARTITIONS may change
# meanwhile. A partition moved to the other list, or given another domain, while a job
# runs there leaves that job's domain or workload behind (deleted from the new list's
# layout, which holds nothing): change the lists between jobs, or delete by hand
# (`imexd domain list`, `imexd workload list`).
#
# Exit status: always 0, as for the layouts' epilogs. A partition in neither list is
# skipped (logged at info); one in both, or an entry of the wrong form, deletes nothing
# and is logged at err. So does an unreadable settings file: its lists are unknown.
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

# The code the slurmctld scripts share (log, the settings, pick_layout, hand_over).
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
pick_layout epilog
hand_over epilog
