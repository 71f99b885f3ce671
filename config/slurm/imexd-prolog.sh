#!/bin/sh
# imexd-prolog.sh: the prolog of a cluster with both layouts, picking one per partition.
#
# Runs imexd-prolog-perjob.sh (a domain job-<id> of its own) for a job on a partition of
# IMEXD_LAYOUT_PERJOB, and imexd-prolog-shared.sh (workload job-<id> in the shared
# domain) for a job on a partition of IMEXD_LAYOUT_SHARED, with IMEXD_DOMAIN set to that
# partition's domain. Those scripts do all the work, as their headers say; this one only
# picks (docs/operations.md, "Slurm: both layouts on one cluster").
#
# Install on the slurmctld host (it runs once per job, at allocation, as SlurmUser),
# beside both layouts' scripts and the code they share, which it runs from its folder
# (without them it logs so at err and exits 2):
#   install -m 0755 imexd-prolog*.sh imexd-epilog*.sh /etc/slurm/
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
#   slurm.conf:
#     PrologSlurmctld=/etc/slurm/imexd-prolog.sh
#     EpilogSlurmctld=/etc/slurm/imexd-epilog.sh
#     TaskProlog=/etc/slurm/imexd-taskprolog.sh        (the script on every node)
#
# Settings, from the environment or from /etc/imexd/slurm.env (IMEXD_SLURM_ENV), as for
# the layouts' scripts, and:
#   IMEXD_LAYOUT_PERJOB  the partitions whose jobs get a domain of their own, separated
#                 by commas or spaces, e.g. "gpu-a,gpu-b"
#   IMEXD_LAYOUT_SHARED  PARTITION:DOMAIN pairs, separated by commas or spaces: the
#                 partitions whose jobs get a channel in that shared domain, e.g.
#                 "rack07:rack-07,rack08:rack-08"
# The two lists replace IMEXD_PARTITIONS (not used here) and IMEXD_DOMAIN (set from the
# list); every other setting (IMEXD_MIN_NODES, IMEXD_WAIT, ...) applies as documented in
# the layouts' scripts.
#
# Exit status: 0 at once, logging why, for a job on a partition in neither list (or
# without a partition). 2 when the partition is in both lists, or an entry has the wrong
# form (a PARTITION:DOMAIN pair in IMEXD_LAYOUT_PERJOB, a bare name in
# IMEXD_LAYOUT_SHARED), naming the setting: the job does not start. Otherwise the
# layout's prolog's own status.
set -eu
PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

# The code the slurmctld scripts share (log, the settings, pick_layout, hand_over).
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
pick_layout prolog
hand_over prolog
