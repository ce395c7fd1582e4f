#!/bin/sh
# The image's entrypoint. `docker run IMAGE fit ...` runs `wsitrain fit ...`; when the first argument is torchrun,
# wsitrain, python, python3 or sh, it runs that program instead (`docker run IMAGE torchrun --nproc-per-node 2 -m
# wsitrain.cli fit ...`). Before wsitrain or torchrun starts, it checks that the run folder can be written.
#
# Why here and not only in wsitrain: the default log.dir `runs` is ./runs (in the image /work/runs, a link to the
# /runs volume). A host folder mounted there that the container's uid cannot write is a docker problem with a docker
# fix (`--user`) that wsitrain knows nothing about, so the check names the uid and both fixes, before anything runs.
#
# Not checked: ./runs that does not exist (wsitrain makes it: Apptainer starts in the host's working folder, where
# there may be none yet); --help, -h and --version, which write nothing; python, python3 and sh, which may do
# anything (`python -c ...` to look around the image).
set -eu

check_runs=yes
case "${1:-}" in
    python | python3 | sh) check_runs=no ;;
esac
for arg in "$@"; do
    case "$arg" in
        --help | -h | --version) check_runs=no ;;
    esac
done

if [ "$check_runs" = yes ] && [ -d runs ] && ! { [ -w runs ] && [ -x runs ]; }; then
    # pwd -P: the folder the link leads to (/runs in the image), the one the user mounted.
    where=$(cd runs 2>/dev/null && pwd -P || echo "$PWD/runs")
    uid=$(id -u)
    gid=$(id -g)
    echo "wsitrain: $where is not writable by uid $uid (gid $gid), so no run folder can be made there:" \
        "run the container as the owner of the host folder mounted at $where" \
        "(docker run --user \$(id -u):\$(id -g) ...), or make that folder writable for uid $uid on the host" \
        "(chown $uid:$gid FOLDER; docker makes a missing one as root, so mkdir it first), and do not mount it" \
        "read-only" >&2
    exit 2
fi

case "${1:-}" in
    torchrun | wsitrain | python | python3 | sh) exec "$@" ;;
    *) exec wsitrain "$@" ;;
esac
