"""Supervisor of one command attempt: ``python -I -S _supervise.py REPLICA_PID ARGV...``.

It runs as the leader of the attempt's process group and execs the command as its
child. The kernel tells it (SIGUSR1, via PR_SET_PDEATHSIG) when the replica dies,
even by kill -9, and it then kills the whole group: nothing the command forked
keeps running beside the retry. Otherwise it only waits and passes the command's
exit status through. It imports nothing from pgflow, to start in milliseconds.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _kill_group(_signum: int, _frame: object) -> None:
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    replica_pid = int(sys.argv[1])
    argv = sys.argv[2:]
    signal.signal(signal.SIGUSR1, _kill_group)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != replica_pid:  # the replica died before prctl took effect
        _kill_group(0, None)
    # The group gets the replica's SIGTERM (timeout, cancel) directly; the supervisor
    # outlives it to report the command's status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            os._exit(127)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
