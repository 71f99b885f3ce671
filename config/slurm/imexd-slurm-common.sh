# shellcheck shell=sh
# imexd-slurm-common.sh: the code that the slurmctld scripts share.
#
# Sourced, never run, by imexd-prolog-perjob.sh, imexd-epilog-perjob.sh,
# imexd-prolog-shared.sh, imexd-epilog-shared.sh and the pair that picks one of them by
# partition, imexd-prolog.sh and imexd-epilog.sh, which find it beside themselves
# (`dirname "$0"`): install it into the same folder, /etc/slurm/ on the slurmctld host:
#   install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh
# A script that cannot read it says so (syslog tag imexd-slurm, priority err) and exits
# as its header promises: 2 from a prolog (the job does not start), 0 from an epilog.
#
# It only defines functions. The scripts call the first three in this order, passing
# their role (prolog or epilog) where the two differ: a prolog fails when it cannot judge
# the job, an epilog logs the trouble at err and goes on, because it must exit 0.
#   read_settings ROLE          the settings file (IMEXD_SLURM_ENV)
#   need_job ROLE               the job's variables (SLURM_JOB_ID, ...)
#   skip_unless_imex ROLE WHAT  the filter (IMEXD_PARTITIONS, IMEXD_MIN_NODES)
#   run_imexd STEP ARGS...      each imexd command, every line it prints logged
#   log PRIORITY MESSAGE, fail STATUS MESSAGE
# The picking pair calls read_settings and need_job, then the two that pick and run the
# partition's layout instead of the filter:
#   pick_layout ROLE            the layout lists (IMEXD_LAYOUT_PERJOB, IMEXD_LAYOUT_SHARED)
#   hand_over ROLE              exec the picked layout's script
# imexd-taskprolog.sh, which runs on the compute nodes as the job's user, keeps its own
# few lines instead: the common file would have to be installed on every node too.

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

# read_settings ROLE: source the settings file ($IMEXD_SLURM_ENV, default
# /etc/imexd/slurm.env) with unset variables allowed, its settings exported. It is
# parsed (`sh -n`) and tried in a subshell first, so that a broken file (one that does
# not parse, or that ends the shell) is reported instead of ending the script half way:
# a prolog then fails 2, an epilog goes on without it. The status of the file's last
# command does not count: `[ -n "$X" ] && KEY=$X` may end it.
read_settings() {
    defaults=${IMEXD_SLURM_ENV:-/etc/imexd/slurm.env}
    [ -r "$defaults" ] || return 0
    # shellcheck source=/dev/null
    if sh -n "$defaults" 2>/dev/null && (set +eu && . "$defaults"; exit 0) >/dev/null 2>&1
    then
        set -a +eu
        # shellcheck source=/dev/null
        . "$defaults"
        set +a -eu
    elif [ "$1" = prolog ]; then
        fail 2 "cannot read the settings in $defaults: run it with sh to see why"
    else
        log err "cannot read the settings in $defaults: run it with sh to see why; going on without"
    fi
}

# need_job ROLE: the job's variables that Slurm gives PrologSlurmctld and
# EpilogSlurmctld. A prolog fails 2 without any of them; an epilog needs only
# SLURM_JOB_ID, and without it deletes nothing and exits 0.
need_job() {
    if [ "$1" = epilog ]; then
        if [ -z "${SLURM_JOB_ID:-}" ]; then
            log err "SLURM_JOB_ID is not set: run this as EpilogSlurmctld; nothing deleted"
            exit 0
        fi
        return 0
    fi
    [ -n "${SLURM_JOB_ID:-}" ] || fail 2 "SLURM_JOB_ID is not set: run this as PrologSlurmctld"
    [ -n "${SLURM_JOB_NODELIST:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_NODELIST is not set"
    [ -n "${SLURM_JOB_UID:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_UID is not set"
    [ -n "${SLURM_JOB_GID:-}" ] || fail 2 "job $SLURM_JOB_ID: SLURM_JOB_GID is not set"
}

# skip_unless_imex ROLE WHAT: the filter. Exit 0 at once, logging why at info, for a job
# that needs no IMEX WHAT (domain or channel): one on a partition that IMEXD_PARTITIONS
# (commas or spaces; empty: every partition) does not list, or on fewer than
# IMEXD_MIN_NODES nodes (default 2). For a prolog it sets nodes, the job's nodes as
# imexd's lowercase comma-separated list, and fails where it cannot judge the job (2 for
# a bad IMEXD_MIN_NODES, 1 when `scontrol show hostnames` fails or names no node). An
# epilog logs those at err and returns, to delete regardless (a miss is harmless).
skip_unless_imex() {
    role=$1
    what=$2
    min_nodes=${IMEXD_MIN_NODES:-2}
    case $min_nodes in
        '' | *[!0-9]*)
            [ "$role" = epilog ] ||
                fail 2 "IMEXD_MIN_NODES=$min_nodes: expected a whole number of nodes"
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
            log info "job $SLURM_JOB_ID: partition ${SLURM_JOB_PARTITION:-(none)} is not in IMEXD_PARTITIONS ($IMEXD_PARTITIONS): no IMEX $what, nothing to do"
            exit 0
        fi
    fi

    if [ "$role" = epilog ]; then
        [ "$min_nodes" -gt 0 ] && [ -n "${SLURM_JOB_NODELIST:-}" ] || return 0
    fi
    # Slurm's node names, one per line, as imexd's lowercase comma-separated list.
    if ! hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST"); then
        why=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1 >/dev/null) || :
        why="job $SLURM_JOB_ID: scontrol show hostnames $SLURM_JOB_NODELIST failed: ${why:-no message}"
        [ "$role" = epilog ] || fail 1 "$why"
        log err "$why; deleting regardless"
        return 0
    fi
    nodes=$(printf '%s\n' "$hosts" | tr '[:upper:]' '[:lower:]' | tr -s '\n' ',')
    nodes=${nodes#,}
    nodes=${nodes%,}
    count=$(printf '%s\n' "$hosts" | grep -c .) || :
    if [ "$role" = prolog ]; then
        [ -n "$nodes" ] || fail 1 "job $SLURM_JOB_ID: no nodes in $SLURM_JOB_NODELIST"
        listing=" ($nodes)"
    else
        listing=""
    fi
    if [ "$count" -lt "$min_nodes" ]; then
        log info "job $SLURM_JOB_ID: $count node(s)$listing, fewer than IMEXD_MIN_NODES=$min_nodes: no IMEX $what, nothing to do"
        exit 0
    fi
}

# run_imexd STEP ARGS...: run imexd ($IMEXD, default imexd on PATH) with ARGS, logging the command line, every line it
# prints (at err when it fails: imexd's own reason) and its exit status, which it
# returns. The output is also kept in $output.
run_imexd() {
    step=$1
    shift
    log info "job-$SLURM_JOB_ID: running ${IMEXD:-imexd} $*"
    result=0
    # Unbuffered: imexd's lines (stdout and stderr) in the order it printed them.
    output=$(PYTHONUNBUFFERED=1 "${IMEXD:-imexd}" "$@" 2>&1) || result=$?
    level=info
    [ "$result" -eq 0 ] || level=err
    printf '%s\n' "$output" | while IFS= read -r line; do
        [ -z "$line" ] || log "$level" "job-$SLURM_JOB_ID: $step: $line"
    done
    log "$level" "job-$SLURM_JOB_ID: imexd $step exited $result"
    return "$result"
}

# pick_layout ROLE: the layout of the job's partition (SLURM_JOB_PARTITION), for the
# pair that serves both: IMEXD_LAYOUT_PERJOB lists partitions, IMEXD_LAYOUT_SHARED
# PARTITION:DOMAIN pairs (both separated by commas or spaces). Sets layout (perjob or
# shared) and, for shared, IMEXD_DOMAIN. A partition in neither exits 0 at once, logging
# why at info. A partition in both, with two domains in IMEXD_LAYOUT_SHARED, or an entry
# of the wrong form is a setup error that names the setting: a prolog fails 2, an epilog
# logs it at err and exits 0 (it cannot tell what the prolog made).
pick_layout() {
    role=$1
    partition=${SLURM_JOB_PARTITION:-}
    perjob=${IMEXD_LAYOUT_PERJOB:-}
    shared=${IMEXD_LAYOUT_SHARED:-}
    layout=""
    set -f
    for entry in $(printf '%s\n' "$perjob" | tr ',' ' '); do
        case $entry in
            *:*) layout_error "$role" "IMEXD_LAYOUT_PERJOB=$perjob: expected partition names, not '$entry' (PARTITION:DOMAIN pairs go in IMEXD_LAYOUT_SHARED)" ;;
        esac
        [ "$entry" != "$partition" ] || layout=perjob
    done
    for entry in $(printf '%s\n' "$shared" | tr ',' ' '); do
        domain=${entry#*:}
        case $entry in
            # "$domain": no colon, so the domain would be the whole entry
            :* | *: | *:*:* | "$domain") layout_error "$role" "IMEXD_LAYOUT_SHARED=$shared: expected PARTITION:DOMAIN pairs, not '$entry'" ;;
        esac
        [ "${entry%:*}" = "$partition" ] || continue
        case $layout in
            perjob) layout_error "$role" "partition $partition is in IMEXD_LAYOUT_PERJOB ($perjob) and IMEXD_LAYOUT_SHARED ($shared): name it in one" ;;
            shared) [ "$domain" = "$IMEXD_DOMAIN" ] ||
                layout_error "$role" "IMEXD_LAYOUT_SHARED=$shared: two domains for partition $partition" ;;
        esac
        layout=shared
        IMEXD_DOMAIN=$domain
    done
    set +f
    if [ -z "$layout" ]; then
        log info "job $SLURM_JOB_ID: partition ${partition:-(none)} is in neither IMEXD_LAYOUT_PERJOB ($perjob) nor IMEXD_LAYOUT_SHARED ($shared): no IMEX, nothing to do"
        exit 0
    fi
}

layout_error() { # layout_error ROLE MESSAGE: fail a prolog (2), end an epilog (0)
    [ "$1" = epilog ] || fail 2 "job $SLURM_JOB_ID: $2; the job does not start"
    log err "job $SLURM_JOB_ID: $2; nothing deleted"
    exit 0
}

# hand_over ROLE: exec the picked layout's script, imexd-ROLE-LAYOUT.sh from this
# script's folder, with the settings already read here: it reads no settings file
# again (IMEXD_SLURM_ENV=/dev/null), so IMEXD_DOMAIN stays the one picked, and it gets
# no IMEXD_PARTITIONS, since the layout lists are the filter. A missing script is a
# setup error as in layout_error.
hand_over() {
    script=$(dirname -- "$0")/imexd-$1-$layout.sh
    [ -r "$script" ] || layout_error "$1" "cannot read $script: install it beside this script"
    where=""
    [ "$layout" = perjob ] || where=", domain $IMEXD_DOMAIN"
    log info "job $SLURM_JOB_ID: partition $partition: layout $layout$where"
    unset IMEXD_PARTITIONS
    IMEXD_SLURM_ENV=/dev/null
    export IMEXD_SLURM_ENV IMEXD_DOMAIN
    exec /bin/sh "$script"
}
